"""scripts/prepare_math.py on small local copies of each set's public file shapes (written here; this machine is
offline): the answers each set needs, the columns kept and dropped, and clear refusals of the wrong shapes."""

import importlib.util
import subprocess
import sys
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.aime_fixture import PROBLEMS

spec = importlib.util.spec_from_file_location("prepare_math", Path(__file__).resolve().parents[2] / "scripts/prepare_math.py")
prepare_math = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_math)

MATH500 = [  # HuggingFaceH4/MATH-500 test.jsonl
    {"problem": "Simplify $\\frac{28}{6}$.", "solution": "Divide by 2: $\\boxed{\\frac{14}{3}}$.",
     "answer": "\\frac{14}{3}", "subject": "Prealgebra", "level": 2, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "... $\\boxed{(3,\\frac{\\pi}{2})}$",
     "answer": "(3,\\frac{\\pi}{2})", "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $2+3$?", "solution": "$\\boxed{5}$", "answer": " 5 ", "subject": "Algebra", "level": 1,
     "unique_id": "test/algebra/2.json"},
]
GSM8K = [  # openai/gsm8k main test
    {"question": "Ann has 3 boxes of 412 pens each. How many pens?", "answer": "3 * 412 = <<3*412=1236>>1236\n#### 1,236"},
    {"question": "Tom had 5 apples and ate 2. How many are left?", "answer": "5 - 2 = <<5-2=3>>3\n#### 3"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(capsys, *args):
    code = prepare_math.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_aime_2024_hub_shape_keeps_id_solution_url_year(tmp_path, capsys):
    rows = [{"id": 60 + i, "problem": p["problem"], "solution": "worked", "answer": str(p["answer"]),
             "url": f"https://example.org/{i}", "year": "2024", "extra": "x"} for i, p in enumerate(PROBLEMS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000-of-00001.parquet")
    code, out, err = run(capsys, "--set", "aime_2024", "--source", tmp_path / "train-00000-of-00001.parquet",
                         "--out", tmp_path / "aime.jsonl")
    assert code == 0, err
    got = read(tmp_path / "aime.jsonl")
    assert [r["answer"] for r in got] == [25, 1, 42, 18, 400]
    assert got[0] == {"problem": PROBLEMS[0]["problem"], "answer": 25, "id": 60, "solution": "worked",
                      "url": "https://example.org/0", "year": "2024"}
    assert "problem <- 'problem', answer <- 'answer'; kept id <- 'id', solution <- 'solution'" in out
    assert "dropped extra" in out and "warning: AIME 2024 has 30 problems; the source gave 5" in err


def test_aime_2024_maxwell_jia_shape_capitalised_columns(tmp_path, capsys):
    rows = [{"ID": f"2024-II-{i}", "Problem": p["problem"], "Solution": "s", "Answer": int(p["answer"])} for i, p in enumerate(PROBLEMS)]
    write_jsonl(tmp_path / "aime_2024_problems.jsonl", rows)
    code, _, err = run(capsys, "--set", "aime_2024", "--source", tmp_path / "aime_2024_problems.jsonl", "--out", tmp_path / "o.jsonl")
    assert code == 0, err
    assert [(r["id"], r["answer"], r["solution"]) for r in read(tmp_path / "o.jsonl")][1] == ("2024-II-1", 1, "s")


def test_aime_2025_from_its_two_halves(tmp_path, capsys):
    first = [{"question": f"Part I problem {i}: find {i}.", "answer": str(i)} for i in range(15)]
    second = [{"question": f"Part II problem {i}: find {100 + i}.", "answer": str(100 + i)} for i in range(15)]
    sources = write_jsonl(tmp_path / "aime2025-I.jsonl", first), write_jsonl(tmp_path / "aime2025-II.jsonl", second)
    code, out, err = run(capsys, "--set", "aime_2025", "--source", *sources, "--out", tmp_path / "aime_2025.jsonl")
    assert code == 0, err
    got = read(tmp_path / "aime_2025.jsonl")
    assert len(got) == 30 and got[15] == {"problem": "Part II problem 0: find 100.", "answer": 100}
    assert out.count("rows; problem <- 'question'") == 2 and "warning" not in err  # 30 problems: the real count


def test_math500_answers_stay_latex_text_with_every_useful_column(tmp_path, capsys):
    write_jsonl(tmp_path / "test.jsonl", MATH500)
    code, out, err = run(capsys, "--set", "math500", "--source", tmp_path / "test.jsonl", "--out", tmp_path / "m.jsonl")
    assert code == 0, err
    got = read(tmp_path / "m.jsonl")
    assert [r["answer"] for r in got] == ["\\frac{14}{3}", "(3,\\frac{\\pi}{2})", "5"]  # "5" is text, for math_verify
    assert set(got[0]) == {"problem", "answer", "solution", "subject", "level", "unique_id"} and got[0]["level"] == 2
    assert "dropped no column" in out and "MATH-500 has 500 problems; the source gave 3" in err


def test_gsm8k_final_answer_after_the_hashes_with_commas(tmp_path, capsys):
    pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "test-00000-of-00001.parquet")
    code, out, err = run(capsys, "--set", "gsm8k", "--source", tmp_path / "test-00000-of-00001.parquet", "--out", tmp_path / "g.jsonl")
    assert code == 0, err
    got = read(tmp_path / "g.jsonl")
    assert [r["answer"] for r in got] == [1236, 3]
    assert got[0]["problem"] == GSM8K[0]["question"] and got[0]["solution"] == GSM8K[0]["answer"]
    assert "solution <- 'answer' (the worked answer)" in out


@pytest.mark.parametrize("raw, value", [("x\n#### 1,234", 1234), ("#### -5", -5), ("a #### 1\nb #### 72", 72), (18, 18),
                                        ("#### 3.5", None), ("The answer is 7", None), ("####", None), (None, None)])
def test_gsm8k_answer_parsing(raw, value):
    assert prepare_math.gsm8k_answer(raw) == value


def test_a_save_to_disk_directory_is_read_with_its_split(tmp_path, capsys):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(MATH500)}).save_to_disk(str(tmp_path / "math500"))
    code, _, err = run(capsys, "--set", "math500", "--source", tmp_path / "math500", "--out", tmp_path / "m.jsonl")
    assert code == 0, err
    assert len(read(tmp_path / "m.jsonl")) == 3


@pytest.mark.parametrize("set_name, rows, message", [
    ("aime_2024", MATH500, "test.jsonl:1: answer '\\\\frac{14}{3}' is not an AIME answer (an integer 0..999) (column 'answer')"),
    ("gsm8k", MATH500, "test.jsonl:1: answer '\\\\frac{14}{3}' is not a GSM8K answer (a worked solution ending in '#### N'"),
    ("gsm8k", [GSM8K[0], {"question": "q", "answer": "7 #### 7.5"}], "test.jsonl:2: answer '7 #### 7.5' is not a GSM8K"),
    ("math500", [MATH500[0], {"problem": "p", "solution": "s"}], "test.jsonl:2: answer None is not a MATH-500 answer"),
    ("math500", [MATH500[0], {"problem": "  ", "answer": "1"}], "test.jsonl:2: column 'problem' is '  ', not a problem's text"),
    ("math500", [{"prompt": "p", "answer": "1"}], "test.jsonl:1: none of the columns prompt, answer looks like problem"),
])
def test_wrong_shapes_are_refused_naming_file_row_and_column(tmp_path, capsys, set_name, rows, message):
    write_jsonl(tmp_path / "test.jsonl", rows)
    code, out, err = run(capsys, "--set", set_name, "--source", tmp_path / "test.jsonl", "--out", tmp_path / "o.jsonl")
    assert code == 2 and message in err, err
    assert not (tmp_path / "o.jsonl").exists() and out == ""


def test_any_integer_is_for_aime_only(tmp_path, capsys):
    write_jsonl(tmp_path / "test.jsonl", GSM8K)
    code, _, err = run(capsys, "--set", "gsm8k", "--source", tmp_path / "test.jsonl", "--out", tmp_path / "o.jsonl", "--any-integer")
    assert code == 2 and "--any-integer is for the AIME sets" in err
    write_jsonl(tmp_path / "big.jsonl", [{"problem": "p", "answer": "1234"}])
    code, _, err = run(capsys, "--set", "aime_2025", "--source", tmp_path / "big.jsonl", "--out", tmp_path / "o.jsonl", "--any-integer")
    assert code == 0 and read(tmp_path / "o.jsonl") == [{"problem": "p", "answer": 1234}] and "warning" not in err


def test_the_script_runs_from_the_command_line(repo, tmp_path):
    write_jsonl(tmp_path / "test.jsonl", GSM8K)
    result = subprocess.run([sys.executable, str(repo / "scripts/prepare_math.py"), "--set", "gsm8k", "--source",
                             str(tmp_path / "test.jsonl"), "--out", str(tmp_path / "g.jsonl")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"wrote 2 problems to {tmp_path / 'g.jsonl'} (0 repeats dropped)" in result.stdout
