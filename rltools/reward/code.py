"""The code verifier (`reward.type: code`): a row's unit tests run against the completion's code in the sandbox.

The program under test is the completion's last fenced ```python block (all of it without one). The
tests are the row's `reward.code.tests_key` column: Python source of asserts (a string: one test; a
list: one test each), or {"inputs": [...], "outputs": [...]} (each input on stdin, its output
expected on stdout, compared line by line without trailing spaces); a JSON string of either is
read as such. The score is the fraction of tests passed, or 1/0 (`reward.code.score: all`).

Invariants:
- One sandbox run per completion (rltools/sandbox: no network, a read-only system, limits on CPU,
  memory, processes, output and time); a program that hangs, crashes or floods its output passes
  only the tests it reported before that. A misbehaving program is a wrong answer (scored, not a
  failure); a row without tests, or a sandbox that could not run, is a failed call (counted).
- A test counts as passed only on a line that carries a random token of that run, written after
  the test returned: ending the process early (`sys.exit(0)`, `os._exit(0)`) or printing "passed"
  passes nothing. It is not a proof against a program that reads its own interpreter's memory for
  the token: read rollouts (`rltools samples`) when scores look too good.
"""

import json
import logging
import math
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from ..config.schema import CodeConfig
from ..sandbox import Limits, SandboxPool
from .failures import ERROR, RewardFailures, Scores
from .scorer import Call, Scorer

log = logging.getLogger("rltools.reward")

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# The harness: runs in the sandbox, stdlib only. The program's own prints during assert tests go to
# stdout too: report lines carry the token, so they cannot be mistaken.
_HARNESS = '''
import contextlib as _c, io as _io, sys as _s
_TOKEN, _PROGRAM, _TESTS, _CASES = {token!r}, {program!r}, {tests!r}, {cases!r}
_out = _s.stdout
def _report(i, ok):
    _out.write(f"{{_TOKEN}} {{i}} {{int(ok)}}\\n"); _out.flush()
def _same(got, expected):
    return [l.rstrip() for l in got.strip().splitlines()] == [l.rstrip() for l in str(expected).strip().splitlines()]
if _TESTS is not None:
    _scope = {{"__name__": "solution"}}
    try:
        exec(compile(_PROGRAM, "solution.py", "exec"), _scope)
    except BaseException:
        _s.exit(0)
    for _i, _test in enumerate(_TESTS):
        try:
            exec(compile(_test, f"test_{{_i}}.py", "exec"), _scope)
            _ok = True
        except BaseException:
            _ok = False
        _report(_i, _ok)
else:
    _code = compile(_PROGRAM, "solution.py", "exec")
    for _i, (_input, _expected) in enumerate(_CASES):
        _got = _io.StringIO()
        _s.stdin = _io.StringIO(str(_input))
        try:
            with _c.redirect_stdout(_got):
                exec(_code, {{"__name__": "__main__"}})
            _ok = _same(_got.getvalue(), _expected)
        except SystemExit as _exit:
            _ok = _exit.code in (None, 0) and _same(_got.getvalue(), _expected)
        except BaseException:
            _ok = False
        _report(_i, _ok)
'''


def program_of(completion: str) -> str:
    """The code a completion gives: its last fenced python block, else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def read_tests(value, key: str) -> tuple[list[str] | None, list[tuple] | None]:
    """(assert tests, None) or (None, stdin/stdout cases) of a row's tests column; ValueError if neither."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        value = parsed if isinstance(parsed, (list, dict)) else [value]
    if isinstance(value, dict) and {"inputs", "outputs"} <= set(value):
        inputs, outputs = list(value["inputs"]), list(value["outputs"])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(f"column {key!r}: {len(inputs)} inputs for {len(outputs)} outputs")
        return None, list(zip(inputs, outputs))
    if isinstance(value, (list, tuple)) and value and all(isinstance(test, str) for test in value):
        return list(value), None
    raise ValueError(f"column {key!r} holds {type(value).__name__}: reward type code needs assert source (a string "
                     "or a list of them) or {inputs: [...], outputs: [...]} (reward.code.tests_key)")


def passed(stdout: str, token: str, count: int) -> int:
    """How many of `count` tests the run reported passed (lines with its token; each test once)."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == token and parts[1].isdigit() and parts[2] in ("0", "1"):
            found.setdefault(int(parts[1]), parts[2] == "1")
    return sum(ok for i, ok in found.items() if i < count)


class CodeScorer(Scorer):
    """Runs each completion's program against its row's tests, reward.code.sandboxes at a time."""

    def __init__(self, config: CodeConfig, timeout_s: float):
        self.config = config
        limits = Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_mb=config.memory_mb)
        self.sandboxes = SandboxPool(config.sandboxes, limits)  # UserError naming what the node lacks
        self.threads = ThreadPoolExecutor(config.sandboxes, thread_name_prefix="code-reward")

    def results(self, calls: list[Call], limit) -> Scores:
        values, failures = [0.0] * len(calls), RewardFailures(calls=len(calls))
        for i, outcome in enumerate(self.threads.map(self._score, calls)):
            if isinstance(outcome, str):
                failures.add(i, ERROR, outcome)
            else:
                values[i] = outcome
        return Scores(values, failures)

    def score(self, call: Call) -> float:
        """The score of one call; ValueError when its row has no tests the verifier reads."""
        key = self.config.tests_key
        if key not in call.columns:
            raise ValueError(f"the row has no column {key!r} (reward.code.tests_key; it has: "
                             f"{', '.join(sorted(call.columns)) or 'none'})")
        tests, cases = read_tests(call.columns[key], key)
        token = secrets.token_hex(16)
        result = self.sandboxes.run(_HARNESS.format(token=token, program=program_of(str(call.completion)),
                                                    tests=tests, cases=cases))
        count = len(tests if tests is not None else cases)
        n = passed(result.stdout, token, count)
        if self.config.score == "all":
            return 1.0 if n == count else 0.0
        return n / count

    def _score(self, call: Call) -> float | str:
        try:
            return self.score(call)
        except Exception as err:  # the row's tests, or the sandbox itself: a failed call, counted
            return f"{type(err).__name__}: {err}"

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        self.sandboxes.close()
