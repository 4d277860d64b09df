"""The model's own format: rows as users keep them (verl's parquet, save_to_disk directories, nested keys,
chat messages) rendered exactly as transformers' apply_chat_template renders and tokenizes them."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltools.config.schema import DataConfig, RewardConfig
from rltools.data.prompts import prompt_format
from rltools.data.tasks import load_tokenizer, make_task
from rltools.errors import UserError

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"
CHATML = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
          "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
VERL_ROWS = [  # the shape verl's and SkyRL's math preprocessing writes
    {"data_source": "aime", "prompt": [{"role": "system", "content": "Think first."},
                                       {"role": "user", "content": "What is 2+3?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0}},
    {"data_source": "aime", "prompt": [{"role": "user", "content": "What is 7*6?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 1}},
]


def verl_data(tmp_path, **keys) -> DataConfig:
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), tmp_path / "train.parquet")
    keys = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth", **keys}
    return DataConfig(train_path=str(tmp_path / "train.parquet"), eval_path=str(tmp_path / "train.parquet"), **keys)


@pytest.mark.parametrize("template, kwargs", [("model", {}), ("chatml", {}), ("chatml", {"enable_thinking": False})])
def test_verl_parquet_prompts_are_apply_chat_template_token_for_token(tmp_path, template, kwargs):
    if template == "chatml":
        (tmp_path / "chatml.jinja").write_text(CHATML)
        template = str(tmp_path / "chatml.jinja")
    data = verl_data(tmp_path, chat_template=template, chat_template_kwargs=kwargs)
    assert data.type == "parquet"  # inferred from the path
    tokenizer = load_tokenizer(TINY)
    task = make_task(data, RewardConfig(type="boxed_integer"), 0, TINY, tokenizer)
    for problem, row in zip(task.eval, VERL_ROWS):
        reference = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                  chat_template=None if data.chat_template == "model" else CHATML,
                                                  **kwargs)["input_ids"]
        assert list(problem.prompt_ids) == reference
        assert problem.answer == int(row["reward_model"]["ground_truth"])
        assert problem.columns["data_source"] == "aime" and problem.columns["extra_info"] == row["extra_info"]
    if kwargs:
        assert task.eval[0].prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_text_prompts_get_the_system_prompt_and_the_template(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"question": "What is 1+1?", "answer": 2}) + "\n")
    data = DataConfig(train_path=str(tmp_path / "p.jsonl"), eval_path=str(tmp_path / "p.jsonl"), prompt_key="question",
                      system_prompt="Be brief.", prompt_template="Q: {prompt}")
    [problem] = make_task(data, RewardConfig(), 0, TINY).eval
    assert problem.prompt == "<s>Be brief. Q: What is 1+1?=" and problem.prompt_ids is None  # no tokenizer: not tokenized
    rows = verl_data(tmp_path, system_prompt="Ignored: the row has its own.")
    assert make_task(rows, RewardConfig(), 0, TINY).eval[0].prompt == "<s>Think first. What is 2+3?="


def test_the_demo_renders_what_the_tiny_model_was_pretrained_on():
    tokenizer = load_tokenizer(TINY)
    for chat in ("model", "none"):
        task = make_task(DataConfig(chat_template=chat), RewardConfig(), 0, TINY, tokenizer)
        [problem] = task.eval_problems(1)
        assert list(problem.prompt_ids) == tokenizer.encode("What is 7*4?=")  # <s> included, once


def test_datasets_directories_read_like_parquet(tmp_path):
    import datasets

    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "train"))
    data = verl_data(tmp_path)
    from_dir = data.model_copy(update={"type": "dataset", "train_path": str(tmp_path / "train"),
                                       "eval_path": str(tmp_path / "train")})
    assert make_task(from_dir, RewardConfig(), 0, TINY).eval == make_task(data, RewardConfig(), 0, TINY).eval
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS),
                          "test": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(str(tmp_path / "both"))
    both = from_dir.model_copy(update={"train_path": str(tmp_path / "both"), "eval_path": str(tmp_path / "both")})
    with pytest.raises(UserError, match=f"splits train, test: point the data path at one split's directory, e.g. "
                                        f"{tmp_path / 'both' / 'train'}"):
        make_task(both, RewardConfig(), 0, TINY)


def test_a_hub_name_is_refused_with_the_offline_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = DataConfig(train_path="openai/gsm8k", eval_path="openai/gsm8k", prompt_key="question")
    assert data.type == "dataset"
    with pytest.raises(UserError, match=r"openai/gsm8k: no such data directory; if 'openai/gsm8k' is a Hugging Face "
                                        r"Hub dataset.*datasets.load_dataset\('openai/gsm8k', split='train'\)"
                                        r".save_to_disk\('DIR'\)"):
        make_task(data, RewardConfig(), 0, TINY)


@pytest.mark.parametrize("keys, message", [
    ({"prompt_template": "{prompt} Answer in \\boxed{{}}."}, "a list of chat messages, which data.prompt_template "
     ".* cannot fill .*: set data.prompt_template: '{prompt}'"),
    ({"chat_template": "none"}, "list of chat messages, but data.chat_template is none"),
    ({"answer_key": "reward_model.answer"}, "no key 'reward_model.answer' \\('answer' missing among: style, "
     "ground_truth\\)"),
])
def test_rows_that_do_not_fit_the_format_are_refused_by_row(tmp_path, keys, message):
    with pytest.raises(UserError, match=f"train.parquet row 0: .*{message}"):
        make_task(verl_data(tmp_path, **keys), RewardConfig(), 0, TINY)


def test_a_model_without_a_template_is_refused_with_the_two_ways_out(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(UserError, match="has no chat template .* set data.chat_template: none .* or the path of a .jinja"):
        prompt_format(DataConfig(), tmp_path)
    assert not prompt_format(DataConfig(chat_template="none"), tmp_path).chat


def test_long_prompts_are_dropped_and_counted_never_cut(tmp_path, caplog):
    rows = [{"problem": "What is 1+1?", "answer": 2}, {"problem": "What is " + "1+" * 30 + "1?", "answer": 31}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(train_path=str(tmp_path / "p.jsonl"), eval_path=str(tmp_path / "p.jsonl"), max_prompt_tokens=20)
    with caplog.at_level(logging.WARNING, "rltools.data"):
        task = make_task(data, RewardConfig(), 0, TINY, load_tokenizer(TINY))
    [train] = task.sources
    assert [p.answer for p in train] == [2] and len(train[0].prompt_ids) == 14
    assert "dropped 1 of 2 problems longer than data.max_prompt_tokens 20 (the longest: 72 tokens)" in caplog.text
    with pytest.raises(UserError, match="every problem is longer than data.max_prompt_tokens 5"):
        make_task(data.model_copy(update={"max_prompt_tokens": 5}), RewardConfig(), 0, TINY, load_tokenizer(TINY))


@pytest.mark.parametrize("keys, message", [
    ({"type": "arithmetic", "train_path": "x.jsonl"}, "data.type arithmetic generates its problems, but "
     "data.train_path is set"),
    ({"type": "parquet", "train_path": "x.jsonl", "eval_path": "x.jsonl"}, "data.train_path x.jsonl reads as "
     "jsonl, but data.type is parquet"),
    ({"train_path": "x.txt", "eval_path": "x.txt"}, "cannot tell its format from its name: set data.type"),
    ({"train_path": "x.jsonl"}, "data.type jsonl needs data.eval_path"),
])
def test_data_keys_that_contradict_the_type_are_refused(keys, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**keys)
    assert DataConfig(train_path="t.parquet", eval_path="e.jsonl").type == "parquet"  # each path read by its name
    assert DataConfig(type="jsonl", train_path="t.txt", eval_path="t.txt").type == "jsonl"


def test_the_login_node_renders_as_transformers_does(monkeypatch):
    """Without transformers (a login node) the preview is rendered by a Jinja environment set up as
    transformers sets up its own: the same text for the shipped template and a ChatML one."""
    from rltools.data import prompts

    messages = [{"role": "system", "content": "S <b>"}, {"role": "user", "content": "What is 1+1?"}]
    tiny = prompt_format(DataConfig(), TINY)
    chatml = prompts.PromptFormat(CHATML + "{{ messages | tojson }}{% generation %}x{% endgeneration %}", "{prompt}",
                                  kwargs={"enable_thinking": False})
    with_transformers = [fmt.render(messages) for fmt in (tiny, chatml)]
    monkeypatch.setitem(__import__("sys").modules, "transformers.utils.chat_template_utils", None)
    assert [fmt.render(messages) for fmt in (tiny, chatml)] == with_transformers
