"""The reward section of the run configuration (re-exported by schema): the verifiers and users'
functions (`reward.functions`), the code verifier's and the judge's settings. Declarations only, as in
schema.py."""

import re
from typing import Literal

from pydantic import Field, model_validator

from .types import EnvPath, Section

INTEGER_VERIFIERS = ("exact_integer", "boxed_integer", "answer_line")
Verifier = Literal["exact_integer", "boxed_integer", "answer_line", "math_verify", "code", "judge", "custom"]
DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the problem below against the reference answer.\n\n"
    "Problem:\n{{ prompt }}\n\nReference answer: {{ answer }}\n\nResponse:\n{{ completion }}\n\n"
    "Reply with one line 'SCORE: N', N from 0 (wrong) to 10 (correct and well argued).")


class RewardFunctionConfig(Section):
    type: Verifier = "custom"
    """A built-in verifier (as reward.type), or custom: the function below."""
    function: str | None = None
    """For type custom: 'module:function'. It is called with the completion and the reference answer, and by
    keyword with what it declares of: prompt (the row's prompt, text or messages), and any column of the row
    (data_source, tests, ...); batched: the plural lists completions, answers, prompts and one list per column.
    It returns a float, or a dict of named floats (each logged; weighted by `weight`); it may be async."""
    name: str | None = None
    """The score's name in metrics.jsonl (reward/<name>) and the logs; default: the type, or the function's name.
    A dict-returning function's scores are named by their keys."""
    weight: float | dict[str, float] = 1.0
    """The reward is the sum over functions of weight x score. For a function that returns a dict: a number
    weighs every score in it alike; a mapping {score: weight} weighs those it names (a call that lacks one of
    them fails) and only logs the others."""
    batched: bool = False
    """Custom functions: called once per batch of completions with lists (completions, answers, prompts, one
    list per column), returning a list of floats or dicts; the batch is split across reward.workers, and
    reward.timeout_s (or timeout_s) is the deadline of one such call."""
    timeout_s: float | None = Field(None, gt=0)
    """This function's deadline per call; null: reward.timeout_s."""

    @model_validator(mode="after")
    def _custom_needs_function(self):
        if (self.type == "custom") != (self.function is not None):
            raise ValueError("a reward function of type custom needs function: 'module:function', and only it")
        if self.batched and self.type != "custom":
            raise ValueError(f"batched is for custom functions; the built-in {self.type} scores one call at a time")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.function.rpartition(":")[2] if self.function else self.type)


class CodeConfig(Section):
    tests_key: str = "tests"
    """The row's column holding the unit tests: Python source of asserts (a string or a list of them, one test
    each), or {inputs: [...], outputs: [...]} (stdin and expected stdout of each test); the completion's last
    ```python block (else all of it) is the program under test."""
    score: Literal["fraction", "all"] = "fraction"
    """fraction: the share of tests passed; all: 1 only when every test passes."""
    memory_mb: int = Field(1024, ge=64)
    """Address space of the program under test (the sandbox's limit; docs/sandbox.md)."""
    sandboxes: int = Field(4, ge=1)
    """Warm sandboxes (and threads) that run programs at once."""


class JudgeConfig(Section):
    model: EnvPath | None = None
    """The judge model's directory (Hugging Face format), served by vLLM on the judge component's engines
    (cluster.judges); needed by a reward function of type judge. Relative paths are relative to the config file."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The judge's dtype in vLLM; auto: its config.json's."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per judge engine (tensor parallel inside a node): cluster.judges.gpus_per_node is ntasks_per_node x this."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """vLLM's KV cache per judge engine, in bytes; needed on CPU (vLLM takes ~90% of RAM otherwise)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of each judge GPU vLLM may use."""
    max_model_len: int | None = Field(None, ge=1)
    """The judge's context length in vLLM; null: its config's."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt: a Jinja template of prompt (the row's prompt as text), messages (the row's messages,
    when it has them), completion, answer, and every column of the row (tests, data_source, ...)."""
    chat: bool = True
    """Send the rendered template as one user message through the judge's chat template (false: as plain text)."""
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """A regular expression whose first group is the score in the judge's reply (its last match counts); a reply
    without a match is a failed call (scores 0, counted as one that returned no number)."""
    score_max: float = Field(10.0, gt=0)
    """The highest score the judge gives: its reply's number is divided by it (a number outside 0..score_max
    is a failed call)."""
    max_tokens: int = Field(512, ge=1)
    """Tokens the judge may write per reply."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature (0: greedy, reproducible)."""
    timeout_s: float = Field(600.0, gt=0)
    """Deadline of one scoring batch (a step's completions of one engine, an evaluation's): calls without a
    reply by then score 0 and count as timed out."""
    start_timeout_s: float = Field(1800.0, gt=0)
    """How long the generators wait for the first judge engine to start (it loads its model) before failing."""

    @model_validator(mode="after")
    def _template_and_pattern(self):
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as err:
            raise ValueError(f"reward.judge.score_pattern is not a regular expression: {err}") from None
        if pattern.groups < 1:
            raise ValueError("reward.judge.score_pattern needs a group around the score, e.g. 'SCORE: (\\d+)'")
        import jinja2  # light: the login side renders the job script with it

        try:
            jinja2.Environment().parse(self.template)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"reward.judge.template, line {err.lineno}: {err.message}") from None
        return self


class RewardConfig(Section):
    type: Verifier = "exact_integer"
    """Verifier: exact_integer (the completion is the answer), boxed_integer (last \\boxed{N}),
    answer_line (DAPO-style 'Answer: N'), math_verify, code (unit tests of the row run on the completion's
    code in the sandbox: reward.code), judge (a model grades it: reward.judge), or custom (reward.function).
    reward.functions combines several."""
    function: str | None = None
    """For type custom: 'module:function', called as reward.functions[].function is. Runs your code."""
    functions: list[RewardFunctionConfig] = []
    """Several reward functions, each scored on every completion, combined as the sum of weight x score; each
    score is logged on its own (metrics.jsonl reward/<name>). Replaces reward.type (left at its default) and
    reward.function."""
    code: CodeConfig = CodeConfig()
    """The code verifier's settings (type code)."""
    judge: JudgeConfig = JudgeConfig()
    """The judge's settings (type judge): its model, served on the judge component (cluster.judges), its prompt
    template, how a score is read from its reply, its deadline. Guide: docs/rewards-and-evaluation.md."""
    timeout_s: float = Field(5.0, gt=0)
    """Hard limit on one reward call (math_verify, code and custom); a call that exceeds it scores 0
    (math_verify, custom: its worker process is replaced; code: the program is killed)."""
    workers: int | None = Field(None, ge=1)
    """Worker processes for math_verify and each custom function; default: CPU cores - 1, at most 4."""
    max_failure_fraction: float = Field(0.5, ge=0, le=1)
    """The run stops with an error naming the reward and its first failure when more than this fraction of
    the calls of a scoring batch (a step's, an evaluation's; smaller batches add up to at least 32 calls)
    failed: timed out, raised, crashed its worker or returned no finite number (math_verify and custom),
    judged for each function apart. Each failed call scores 0; metrics.jsonl counts them per step
    (reward_failures, and reward_failures/<name> with several functions). 1: never stop."""

    @model_validator(mode="after")
    def _custom_needs_function(self):
        if self.functions:
            if self.type != "exact_integer" or self.function:  # the default: nothing to replace
                raise ValueError(f"reward.functions replaces reward.type and reward.function: list that verifier "
                                 f"among reward.functions (- type: {self.type}"
                                 f"{f', function: {self.function}' if self.function else ''}) and drop them")
            labels = [f.label for f in self.functions]
            twice = sorted({label for label in labels if labels.count(label) > 1})
            if twice:
                raise ValueError(f"reward.functions: two functions are named {twice[0]}: give one a `name`")
        elif self.type == "custom" and not self.function:
            raise ValueError("reward.type custom needs reward.function: 'module:function'")
        if self.uses_judge and not self.judge.model:
            raise ValueError("a reward function of type judge needs reward.judge.model: the judge model's directory")
        if not self.uses_judge and self.judge != JudgeConfig():
            keys = [f"reward.judge.{name}" for name, value in self.judge if value != JudgeConfig.model_fields[name].default]
            raise ValueError(f"{', '.join(keys)} set, but no reward function is of type judge: add one (reward.type: "
                             "judge, or - type: judge among reward.functions) or drop reward.judge")
        return self

    @property
    def uses_judge(self) -> bool:
        """Whether a function of the reward is the judge (the job then has a judge component)."""
        return any(f.type == "judge" for f in self.functions) if self.functions else self.type == "judge"

    @property
    def kind(self) -> str:
        """reward.type, or 'functions' for a combination: what an eval set without a verifier of its own uses."""
        return "functions" if self.functions else self.type

    @property
    def integer_answers(self) -> bool:
        """Whether reference answers are read as integers: an integer verifier is among the functions."""
        return any(f.type in INTEGER_VERIFIERS for f in self.functions) if self.functions \
            else self.type in INTEGER_VERIFIERS
