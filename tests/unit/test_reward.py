import time

import pytest

from rltools.config.schema import RewardConfig
from rltools.errors import UserError
from rltools.reward import answer_extractor, extract_answer, make_reward
from rltools.reward.extract import TAIL_CHARS, integer_answer, last_boxed, parse_integer
from rltools.reward.failures import ERROR, NOT_A_NUMBER, TIMEOUT
from rltools.reward.pool import TimeoutPool, Warmup
from rltools.reward.verifiers import INLINE, answer_line_integer, boxed_integer

ADVERSARIAL = [
    "",
    "\\boxed{}",
    "\\boxed{",
    "}}}}\\boxed{{{{",
    "\\boxed{1}\\boxed{2}\\boxed{3",
    "\\boxed{\\boxed{\\boxed{7}}}",
    "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",
    "\\boxed{" * 20_000,
    "x" * 100_000,
    ("\\boxed{1}" + "é∑😀\u202e" * 25_000),
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{" + "9" * 10_000 + "}",
    "\\boxed{１２３}",  # fullwidth digits are not ASCII digits
    "\x00\\boxed{\x00}",
    "Answer: " + "1" * 5000,
    "Answer: " + "**$\\boxed{" * 1000 + "7" + "}$**" * 1000,  # more wrapping layers than are peeled
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_integer_verifiers_give_a_verdict_quickly_on_hostile_text(text):
    start = time.perf_counter()
    for verifier in (boxed_integer, answer_line_integer):
        assert verifier(text, 7) in (0.0, 1.0)
    assert time.perf_counter() - start < 0.5  # milliseconds here; backtracking would take seconds or hours


def test_the_last_balanced_box_wins():
    assert boxed_integer("first \\boxed{12} then \\boxed{25}", 25) == 1.0
    assert boxed_integer("first \\boxed{25} then \\boxed{12}", 25) == 0.0
    assert boxed_integer("\\boxed{25} and a truncated \\boxed{3", 25) == 1.0  # unclosed: the previous box
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # nested braces kept whole
    assert boxed_integer("\\boxed{\\boxed{7}}", 7) == 1.0


@pytest.mark.parametrize(
    "text", ["\\boxed{25}", "$\\boxed{25}$", "\\boxed{025}", "\\boxed{\\text{25}}", "\\boxed{25}.", "\\boxed{25.}",
             "\\boxed{ 25 }", "\\boxed{$25$}", "\\fbox{25}", "\\boxed {25}", "\\boxed{\\textbf{25}}"],
)
def test_presentation_around_the_integer_is_tolerated(text):
    assert boxed_integer(text, 25) == 1.0


@pytest.mark.parametrize("text", ["\\boxed{25.5}", "\\boxed{1/2}", "\\boxed{2 5}", "\\boxed{x=25}", "\\boxed{}",
                                  "25", "\\boxed{10^{2}}", "\\boxed{２５}"])
def test_what_is_not_an_integer_scores_zero(text):
    assert boxed_integer(text, 25) == 0.0


def test_only_the_tail_is_read():
    assert boxed_integer("\\boxed{25}" + " " * TAIL_CHARS, 25) == 0.0
    assert boxed_integer(" " * 10 * TAIL_CHARS + "\\boxed{25}", 25) == 1.0


@pytest.mark.parametrize("text, answer", [
    ("Answer: \\boxed{60}", 60), ("Answer: \\(60\\)", 60), ("Answer: \\[60\\]", 60), ("Answer: $\\boxed{-45}$", -45),
    ("**Answer: 45**", 45), ("**Answer:** 45", 45), ("Answer: **45**", 45), ("Answer: `45`", 45),
    ("**Answer:** $\\boxed{45}$.", 45), ("Answer: $$ \\boxed{\\text{45}} $$", 45),
])
def test_answer_line_sees_through_markdown_delimiters_and_a_box(text, answer):
    assert answer_line_integer(f"Some thought.\n{text}\n", answer) == 1.0


@pytest.mark.parametrize("text, answer", [
    ("Answer: **4**5", 45), ("Answer: \\boxed{60} or 61", 60), ("Answer: \\boxed{60}\\boxed{61}", 60),
    ("Answer: \\boxed{6}0", 60), ("**Answer:** 12.5", 12), ("Answer: \\(1/2\\)", 1), ("Answer: $\\boxed{x=3}$", 3),
    ("Answer: .45", 45),
])
def test_answer_line_wrappers_do_not_make_a_non_integer_an_answer(text, answer):
    assert answer_line_integer(text, answer) == 0.0


def test_answer_line_takes_the_last_one():
    assert answer_line_integer("Answer: 3\nsome more thought\nAnswer: 025\n", 25) == 1.0
    assert answer_line_integer("the answer: $25$.", 25) == 1.0
    assert answer_line_integer("Answer: 25 apples", 25) == 0.0
    assert answer_line_integer("no line here", 25) == 0.0


def test_reference_answers_normalise():
    assert [integer_answer(a) for a in ("025", 25, 25.0, " 7 ", "x", 2.5, True, None)] == [25, 25, 25, 7, None, None, None, None]
    assert parse_integer(None) is None


def test_integer_verifiers_cost_microseconds():
    texts = ["Let me think. " * 200 + f"So the answer is \\boxed{{{i:03d}}}." for i in range(1000)]
    reward = make_reward(RewardConfig(type="boxed_integer"))
    start = time.perf_counter()
    scores = reward.score(texts, list(range(1000)))
    per_call = (time.perf_counter() - start) / len(texts)
    assert scores == [1.0] * 1000
    # A guard against a super-linear regression (a backtracking regex: milliseconds to seconds a call),
    # not a benchmark: ~14 us here quiet, 232 us seen with both cores busy, so 2 ms holds on any host.
    assert per_call < 2e-3, f"{per_call * 1e6:.1f} us a call"


@pytest.mark.parametrize("reward_type, text, answer", [
    ("exact_integer", " 81\n", 81), ("exact_integer", "081", None), ("exact_integer", "81 is it", None),
    ("boxed_integer", "so \\boxed{12} then \\boxed{$025$}.", 25), ("boxed_integer", "\\boxed{2.5}", None),
    ("answer_line", "thinking\n**Answer:** $\\boxed{-45}$.\n", -45), ("answer_line", "Answer: 4 apples", None),
    ("math_verify", "so \\boxed{ \\frac{1}{2}\n+ x }", "\\frac{1}{2} + x"), ("math_verify", "\\boxed{ }", None),
    ("math_verify", "\\boxed{042}", "042"), ("math_verify", "no box", None),
    ("custom", "\\boxed{7}", None), ("no_such_type", "\\boxed{7}", None),
])
def test_extract_answer_gives_each_reward_types_final_answer(reward_type, text, answer):
    assert extract_answer(reward_type, text) == answer
    assert type(extract_answer(reward_type, text)) is type(answer)  # 25, not "25"; "042", not 42


def test_custom_rewards_have_no_extractor():
    assert answer_extractor("custom") is None
    assert all(answer_extractor(t) is not None for t in [*INLINE, "math_verify"])


@pytest.mark.parametrize("text", [*ADVERSARIAL, None, 7, b"\\boxed{7}"], ids=range(len(ADVERSARIAL) + 3))
def test_extract_answer_never_raises_and_is_quick(text):
    start = time.perf_counter()
    for reward_type in ("exact_integer", "boxed_integer", "answer_line", "math_verify", "custom"):
        assert extract_answer(reward_type, text) is None or isinstance(extract_answer(reward_type, text), (int, str))
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("text", ["\\boxed{25}", "Answer: 25", "25", "\\boxed{025}\nAnswer: **7**", "x", "\\boxed{7}"])
def test_an_integer_rewards_vote_agrees_with_its_score(text):
    for reward_type, score in INLINE.items():
        for answer in (7, 25):
            assert score(text, answer) == float(extract_answer(reward_type, text) == answer), (reward_type, answer)


def test_pool_survives_hangs_errors_crashes_and_junk():
    pool = TimeoutPool("tests.unit.reward_fns:hang", timeout_s=0.5, workers=2)
    try:
        start = time.perf_counter()
        scores = pool.map([(("a", 1), {})] * 3)
        assert scores == [0.0, 0.0, 0.0]
        assert time.perf_counter() - start < 0.5 * 2 + 10  # ceil(3 / 2) deadlines + worker restarts
        assert scores.failures.failed == {0: TIMEOUT, 1: TIMEOUT, 2: TIMEOUT} and scores.failures.calls == 3
    finally:
        pool.close()
    for name, kind, first in (("raise_error", ERROR, "RuntimeError: boom"), ("crash", ERROR, "died (exit code 3)"),
                              ("not_a_number", NOT_A_NUMBER, "returned 'yes', not a finite number")):
        pool = TimeoutPool(f"tests.unit.reward_fns:{name}", timeout_s=5, workers=1)
        try:
            scores = pool.map([(("a", 1), {}), (("b", 2), {})])
            assert scores == [0.0, 0.0], name
            assert scores.failures.failed == {0: kind, 1: kind} and first in scores.failures.first, scores.failures
        finally:
            pool.close()


def test_pool_returns_results_in_order():
    pool = TimeoutPool("tests.unit.reward_fns:length_is_answer", timeout_s=5, workers=2)
    try:
        calls = [(("x" * i, 3), {}) for i in range(8)]
        assert pool.map(calls) == [1.0 if i == 3 else 0.0 for i in range(8)]
    finally:
        pool.close()


def test_warm_up_keeps_a_slow_first_call_out_of_the_deadline():
    # the first call of each worker takes 1.5 s (a lazy import), three times reward.timeout_s
    pool = TimeoutPool("tests.unit.reward_fns:slow_first_call", timeout_s=0.5, workers=2, warmup=Warmup(("1", 1), 1.0))
    try:
        assert pool.map([(("33", 33), {}), (("7", 7), {}), (("8", 9), {})]) == [1.0, 1.0, 0.0]
    finally:
        pool.close()


@pytest.mark.parametrize("failure", ["hang", "crash"])
def test_a_replaced_worker_is_warm_before_its_next_call(failure):
    pool = TimeoutPool("tests.unit.reward_fns:slow_first_call", timeout_s=0.5, workers=1, warmup=Warmup(("1", 1), 1.0))
    try:
        assert pool.map([((failure, 1), {}), (("33", 33), {}), (("34", 34), {})]) == [0.0, 1.0, 1.0]
    finally:
        pool.close()


@pytest.mark.parametrize("function, warmup, message", [
    ("length_is_answer", Warmup(("ab", 3), 1.0), r"length_is_answer'.* warm-up .*returned 0.0, expected 1.0"),
    ("raise_error", Warmup(("a", 1), 1.0), r"raise_error'.* warm-up .*RuntimeError: boom"),
    ("not_a_number", Warmup(("a", 1), 1.0), r"not_a_number'.* warm-up .*returned 'yes', not a finite number"),
    ("crash", Warmup(("a", 1), 1.0), r"crash'.* warm-up .*exited with code 3"),
])
def test_a_failing_warm_up_stops_the_pool_naming_the_function(function, warmup, message):
    with pytest.raises(ValueError, match=message):
        TimeoutPool(f"tests.unit.reward_fns:{function}", timeout_s=5, workers=2, warmup=warmup)


@pytest.mark.parametrize("function, message", [
    ("tests.unit.reward_fns:missing", "has no attribute 'missing'"),
    ("tests.unit.no_such_module:f", "No module named"),
    ("tests.unit.reward_fns:NOT_CALLABLE", "not callable"),
    ("no_colon", "expected 'module:function'"),
])
def test_custom_reward_that_cannot_load_is_a_user_error(function, message):
    with pytest.raises(UserError, match=message):
        make_reward(RewardConfig(type="custom", function=function, workers=1))


def test_custom_reward_runs_the_users_function():
    reward = make_reward(RewardConfig(type="custom", function="rltools.data.arithmetic:reward", workers=1))
    try:
        assert reward.score(["81", "18", "\\boxed{81}"], [81, 81, 81]) == [1.0, 0.0, 0.0]
    finally:
        reward.close()


def test_math_verify_checks_equivalence_and_times_out_on_towers():
    pytest.importorskip("math_verify", reason="math-verify is an optional extra: pip install 'rltools[math]'")
    reward = make_reward(RewardConfig(type="math_verify", timeout_s=3.0, workers=2))
    try:
        assert reward.score(["so \\boxed{\\frac{1}{2}}", "so \\boxed{0.5}", "\\boxed{3}"], ["1/2", "\\frac12", "1/2"]) == [1.0, 1.0, 0.0]
        start = time.perf_counter()
        scores = reward.score(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{}", "x" * 100_000], ["1", "1", "1"])
        assert scores == [0.0, 0.0, 0.0]
        assert time.perf_counter() - start < 3.0 * 2 + 15
    finally:
        reward.close()


def test_math_verify_scores_the_first_call_of_a_fresh_pool():
    # importing math-verify and its first parse take ~0.9 s here: without the warm-up they ran
    # inside this call's deadline and a correct answer scored 0
    pytest.importorskip("math_verify", reason="math-verify is an optional extra: pip install 'rltools[math]'")
    reward = make_reward(RewardConfig(type="math_verify", timeout_s=0.5, workers=1))
    try:
        assert reward.score(["so the answer is \\boxed{33}"], [33]) == [1.0]
    finally:
        reward.close()


def test_pool_works_from_a_script_without_a_main_guard(tmp_path):
    # multiprocessing's spawn re-runs such a script in every worker and fails; fresh interpreters do not.
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "from rltools.config.schema import RewardConfig\nfrom rltools.reward import make_reward\n"
        "r = make_reward(RewardConfig(type='custom', function='rltools.data.arithmetic:reward', workers=1))\n"
        "print(r.score(['81', '7'], [81, 81]))\nr.close()\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1.0, 0.0]"
