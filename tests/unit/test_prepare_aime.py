"""scripts/prepare_aime.py on local sources (this machine is offline): normalises, de-duplicates, refuses bad answers."""

import csv
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from rltools.config.schema import DataConfig, RewardConfig
from rltools.data.tasks import make_task
from tests.unit.aime_fixture import PROBLEMS, write_jsonl
from tests.unit.test_prompts import TINY


def prepare(repo, *args):
    return subprocess.run([sys.executable, str(repo / "scripts/prepare_aime.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_with_repeats_and_padded_answers(repo, tmp_path):
    write_jsonl(tmp_path / "src.jsonl", repeat=32)
    out = tmp_path / "data" / "aime_2024.jsonl"
    result = prepare(repo, "--source", tmp_path / "src.jsonl", "--out", out)
    assert result.returncode == 0, result.stderr
    assert f"wrote 5 problems to {out} (155 repeats dropped)" in result.stdout
    assert "has 30 problems" in result.stderr  # the fixture is not the real set: said, not hidden
    assert [p["answer"] for p in read(out)] == [25, 1, 42, 18, 400]
    data = DataConfig(type="jsonl", train_path=str(out), eval_path=str(out))  # what configs/aime.yaml reads
    assert [p.answer for p in make_task(data, RewardConfig(type="boxed_integer"), 0, TINY).eval] == [25, 1, 42, 18, 400]


def test_csv_and_parquet_with_other_column_names(repo, tmp_path):
    rows = [{"ID": f"2024-I-{i}", "Question": r["problem"], "Answer": str(r["answer"])} for i, r in enumerate(PROBLEMS)]
    with open(tmp_path / "src.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["ID", "Question", "Answer"])
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "src.parquet")
    for source in ("src.csv", "src.parquet"):
        result = prepare(repo, "--source", tmp_path / source, "--out", tmp_path / f"{source}.jsonl")
        assert result.returncode == 0, result.stderr
        got = read(tmp_path / f"{source}.jsonl")
        assert [(p["id"], p["answer"]) for p in got] == [(f"2024-I-{i}", a) for i, a in enumerate([25, 1, 42, 18, 400])]


def test_a_datasets_source_goes_through_load_dataset(repo, tmp_path):
    source = tmp_path / "hub_like"
    source.mkdir()
    write_jsonl(source / "train.jsonl", repeat=2)
    result = prepare(repo, "--source", source, "--split", "train", "--out", tmp_path / "out.jsonl")
    assert result.returncode == 0, result.stderr
    assert "(5 repeats dropped)" in result.stdout and len(read(tmp_path / "out.jsonl")) == 5


def test_answers_outside_aime_range_and_missing_columns_are_refused(repo, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "p", "answer": "1000"}) + "\n")
    result = prepare(repo, "--source", tmp_path / "bad.jsonl", "--out", tmp_path / "out.jsonl")
    assert result.returncode == 2 and "bad.jsonl:1: answer '1000' is not an AIME answer" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
    result = prepare(repo, "--source", tmp_path / "bad.jsonl", "--out", tmp_path / "out.jsonl", "--answer-key", "solution")
    assert result.returncode == 2 and "no column 'solution'" in result.stderr


def test_configs_aime_reads_the_prepared_file(repo, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "src.jsonl", repeat=3)
    assert prepare(repo, "--source", tmp_path / "src.jsonl", "--out", tmp_path / "aime_2024.jsonl").returncode == 0
    write_jsonl(tmp_path / "aime_train.jsonl")
    monkeypatch.setenv("RLTOOLS_DATA", str(tmp_path))
    from rltools.config import load_config

    config = load_config(repo / "configs" / "aime.yaml")
    task = make_task(config.data, config.reward, config.run.seed, TINY)  # the tiny model's chat template
    problem = task.eval_problems(config.eval.problems)[0]
    assert problem.prompt.endswith("put your final answer within \\boxed{}.=") and problem.answer == 25
    completions = ["... so $N = 25$, and the answer is $\\boxed{025}$.", "\\boxed{25.5}"]
    assert task.reward.score(completions, [problem.answer] * 2) == [1.0, 0.0]
    assert len(task.train_problems(step=0, count=config.schedule.prompts_per_step)) == config.schedule.prompts_per_step
