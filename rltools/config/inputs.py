"""The sections of what a run reads and how it is judged: its data (files, chat format, mixing) and its
eval sets. Declared here, re-exported by `schema` (the rest of the run configuration).

Invariant: as in `schema`: every key declared with its type and default and a docstring; unknown keys
are errors; a path's format follows from its name.
"""

from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from .types import EnvPath, Section

FILE_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def path_kind(path: str) -> str | None:
    """A data path's format by its name: .jsonl/.json, .parquet, or no suffix: a directory written by
    datasets' save_to_disk; None for another suffix (data.type says)."""
    suffix = PurePath(path).suffix.lower()
    if suffix in FILE_KINDS:
        return FILE_KINDS[suffix]
    return "dataset" if not suffix else None


class SourceConfig(Section):
    path: EnvPath
    """Its problems: a .jsonl / .parquet file or a save_to_disk directory."""
    weight: float = Field(1.0, gt=0)
    """Its share of the training stream, relative to the other sources' weights."""
    prompt_key: str | None = None
    """Column of the prompt in this source; null: data.prompt_key."""
    answer_key: str | None = None
    """Column of the reference answer in this source; null: data.answer_key."""


class DataConfig(Section):
    type: Literal["arithmetic", "products", "jsonl", "parquet", "dataset"] = None
    """Prompt source: generated arithmetic problems (the demo's), two-digit products (the tool demo's),
    or files: jsonl, parquet, or a `datasets` directory written by save_to_disk. null: inferred, from
    data.train_path's (or the first train_mix source's) name (.jsonl/.json, .parquet, a directory) when
    it is set, else arithmetic; each data path is read by its own name's format."""
    train_path: EnvPath | None = None
    """Training problems: a .jsonl / .parquet file or a save_to_disk directory (of one split)."""
    train_mix: list[SourceConfig] = []
    """Several training sources mixed by weight, in place of data.train_path: each position of the
    training stream draws its source by weight (seeded), and each source is visited in its own
    shuffled epochs."""
    eval_path: EnvPath | None = None
    """Held-out problems for the run's evaluations (same formats); may be the training file."""
    prompt_key: str = "problem"
    """Column holding the prompt: text, or a list of chat messages ({role, content}: verl's `prompt`).
    Dots reach into nested columns."""
    answer_key: str = "answer"
    """Column holding the reference answer; dots reach into nested columns, e.g. reward_model.ground_truth."""
    chat_template: str = "model"
    """How prompts are given to the model: model (the tokenizer's chat template, with the generation
    prompt: an instruct model's own format), none (raw text through prompt_template: a base model), or
    the path of a Jinja chat template file."""
    chat_template_kwargs: dict[str, Any] = {}
    """Arguments the chat template reads, e.g. {enable_thinking: false} for Qwen3."""
    system_prompt: str | None = None
    """A system message put before every prompt that has none of its own (chat templates only)."""
    prompt_template: str | None = None
    """Applied to text prompts (Python str.format): `{prompt}` is replaced by the problem text; write
    literal braces doubled, e.g. `\\boxed{{}}`. Under a chat template it makes the user message. null:
    `{prompt}`; raw arithmetic (chat_template none) `{prompt}=`, the tiny models' answer cue, which their
    chat template writes itself."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Rows whose rendered prompt is longer than this many tokens are dropped (counted in the log, never
    cut); null: none dropped."""
    dedupe: bool = True
    """Drop repeated problems (same text after whitespace normalisation), keeping the first: some
    public copies of AIME 2024 repeat each problem many times."""

    @model_validator(mode="before")
    @classmethod
    def _type_from_the_train_path(cls, values):
        if not isinstance(values, dict):
            return values
        declared = values.get("type")
        mix = [(f"train_mix[{i}].path", source.get("path") if isinstance(source, dict) else getattr(source, "path"))
               for i, source in enumerate(values.get("train_mix") or [])]
        given = [(key, values.get(key)) for key in ("train_path", "eval_path")] + mix
        if declared is None:
            key, path = next(((k, p) for k, p in given if p is not None and k != "eval_path"), ("train_path", None))
            kind = "arithmetic" if path is None else path_kind(str(path))
            if kind is None:
                raise ValueError(f"data.{key} {path}: cannot tell its format from its name: set data.type "
                                 "(jsonl, parquet or dataset)")
            return {**values, "type": kind}
        for key, path in given:
            kind = None if path is None else path_kind(str(path))
            if declared not in ("arithmetic", "products") and kind not in (None, declared):
                raise ValueError(f"data.{key} {path} reads as {kind}, but data.type is {declared}: remove data.type "
                                 "(it is inferred from the paths) or fix it")
        return values

    @model_validator(mode="after")
    def _paths_fit_the_type(self):
        if self.type in ("arithmetic", "products"):
            given = [key for key in ("train_path", "train_mix", "eval_path") if getattr(self, key)]
            if given:
                raise ValueError(f"data.type {self.type} generates its problems, but data.{given[0]} is set: your file "
                                 "would be ignored. Remove data.type (it is inferred from the path) or the path")
            return self
        if self.train_path is not None and self.train_mix:
            raise ValueError("data.train_path and data.train_mix are both set: give one source as train_path, or "
                             "every source (that one included) in train_mix")
        for key in ("train_path", "eval_path"):
            if getattr(self, key) is None and not (key == "train_path" and self.train_mix):
                raise ValueError(
                    f"data.type {self.type} needs data.{key} (train_path: training problems, or train_mix; eval_path: "
                    "held-out problems for avg@k, which may be the training file)"
                )
        return self

    def train_sources(self) -> list[SourceConfig]:
        """The training sources: train_mix, or train_path as the one source."""
        return list(self.train_mix) or [SourceConfig(path=self.train_path)]



HELD_OUT = "held_out"  # the eval set of a run without eval.sets: its held-out problems


class EvalSetConfig(Section):
    path: EnvPath | None = None
    """Its problems: a .jsonl / .parquet file or a save_to_disk directory, read with data.prompt_key /
    answer_key and the run's chat format; null: the run's held-out problems (data.eval_path, or the
    generated held-out arithmetic)."""
    prompt_key: str | None = None
    """Column of the prompt in this set's file; null: data.prompt_key."""
    answer_key: str | None = None
    """Column of the reference answer in this set's file; null: data.answer_key."""
    reward: Literal["exact_integer", "boxed_integer", "answer_line", "math_verify", "code", "custom"] | None = None
    """Verifier of this set (custom: reward.function; code: reward.code); null: the run's reward (reward.type,
    or the weighted sum of reward.functions)."""
    k: int | None = Field(None, ge=1)
    """Samples per problem (avg@k, pass@k, maj@k); null: eval.k. Greedy sets sample once."""
    problems: int | None = Field(None, ge=1)
    """Problems evaluated: the first N of the file (a truncation is logged); null: eval.problems."""
    greedy: bool = False
    """Sample greedily (temperature 0, one sample a problem): temperature and top_p do not apply."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature; null: generator.temperature."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling threshold; null: generator.top_p."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Completion length limit; null: generator.max_new_tokens."""

    @model_validator(mode="after")
    def _greedy_is_one_sample(self):
        if self.greedy and (self.k not in (None, 1) or self.temperature is not None or self.top_p is not None):
            raise ValueError("a greedy eval set samples once at temperature 0: drop its k, temperature and top_p")
        return self


class EvalConfig(Section):
    k: int = Field(8, ge=1)
    """Samples per problem: quality is reported as avg@k (mean accuracy), pass@k and maj@k (majority vote)."""
    problems: int | None = Field(None, ge=1)
    """Problems of each eval set evaluated (the first N of its file; a truncation is logged); null: all
    (the generated arithmetic held-out problems: 256)."""
    sets: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+$")], EvalSetConfig] = {}
    """Named eval sets, each with its own file, verifier, k and sampling, reported separately; empty: one
    set, held_out (the run's held-out problems, eval.k samples at the generator's sampling). The first
    set is the run's headline: the progress line, status' first eval line, the plot's title."""
    keep_full_exports: int = Field(2, ge=1)
    """Complete-model policy exports kept for `rltools eval` (weight_sync full: the newest N evaluated
    policies; older ones are deleted, their results stay in eval/). LoRA adapter exports are all kept."""


