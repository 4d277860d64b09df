"""Tool environments without a sandbox: the calculator, and the Hermes tool-call parser of the python
tool (its malformed calls are answered before any program runs). The python tool's runs are in
tests/integration/test_tool_env.py."""

import json

import pytest

from rltools.config.schema import EnvConfig
from rltools.data.arithmetic import Problem
from rltools.envs import Reply, make_environment
from rltools.envs import tools as tools_module
from rltools.envs.base import SingleTurn
from rltools.envs.calculator import CalcError, evaluate
from rltools.envs.python_tool import CallError, parse_call
from rltools.envs.tools import ToolEnvironment

CHATML = "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


def calculator(**fields) -> ToolEnvironment:
    return make_environment(EnvConfig(type="tools", tools=["calculator"], **fields))


@pytest.fixture
def python_env(monkeypatch):
    """A python-tool environment whose sandbox is never reached (the node check is skipped)."""
    monkeypatch.setattr(tools_module, "check_host", lambda: "bwrap")
    return make_environment(EnvConfig(type="tools", tools=["python"], observation_template=CHATML))


def test_the_tool_demo_string_is_an_episode():
    env = calculator()
    assert env.stop == ("</calc>",)
    problem = Problem(prompt="What is 37*48?=", answer=1776)  # as the tiny models' chat template renders it
    env.reset(problem)
    prompt = problem.prompt
    turn = "<calc>37*48</calc>"
    reply = env.step(turn)
    assert reply == Reply("<result>1776</result>", tool_call=True, tool_error=False)
    assert env.step("1776") == Reply(None)
    assert prompt + turn + reply.observation + "1776" == "What is 37*48?=<calc>37*48</calc><result>1776</result>1776"


@pytest.mark.parametrize("expression, value", [
    ("37*48", "1776"), ("(2+3)*4", "20"), ("2**10", "1024"), ("-7//2", "-4"), ("-7%3", "2"), ("84/2", "42"),
    ("7/2", "3.5"), ("2/3", "0.666667"), ("1/8", "0.125"), ("2**-2", "0.25"), (" 1 - 5 ", "-4"),
    ("2**99", str(2**99)), ("1**123456789012345678901234567", "1"),
])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value
    assert calculator().step(f"<calc>{expression}</calc>") == Reply(f"<result>{value}</result>", True, False)


@pytest.mark.parametrize("expression", [
    "1/0", "5%0", "0**-1", "", "1+", "37x48", "abs(-1)", "__import__('os')", "1.5*2", "0x10", "1_000", "007",
    "1(2)", "2**(1/2)", "(" * 150 + "1" + ")" * 150, "1" * 201,
])
def test_invalid_expressions_are_errors(expression):
    with pytest.raises(CalcError):
        evaluate(expression)
    assert calculator().step(f"<calc>{expression}</calc>") == Reply("<result>error</result>", True, True)


@pytest.mark.parametrize("expression", ["9**9**9", "10**30", "2**100", "99999999999999999999*99999999999",
                                        "(1/3)**100", "10**-30"])
def test_huge_numbers_are_errors_not_hangs(expression):
    with pytest.raises(CalcError, match="too large"):
        evaluate(expression)


def test_a_call_is_the_turn_ending_at_the_closing_tag():
    env = calculator()
    # The call is the last <calc> before the closing tag; text before it is the model's own.
    assert env.step("So <calc>1+1</calc> gave 2, now <calc>3*3</calc>\n").observation == "<result>9</result>"
    assert env.step("</calc>") == Reply("<result>error</result>", True, True)  # a closing tag alone
    assert env.step("<calc><calc>2</calc>") == Reply("<result>2</result>", True, False)


@pytest.mark.parametrize("turn", ["1776", "", "<calc>37*48", "<calc>37*48</calc> so 1776", "<result>5</result>",
                                  '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'])
def test_a_turn_without_a_call_ends_the_episode(turn):
    assert calculator().step(turn) == Reply(None)


def test_the_observation_template_wraps_every_answer():
    env = calculator(observation_template="\n[{observation}]\n")
    assert env.step("<calc>2*3</calc>").observation == "\n[<result>6</result>]\n"
    assert env.step("<calc>2*</calc>").observation == "\n[<result>error</result>]\n"
    with pytest.raises(ValueError, match="cannot be filled"):
        calculator(observation_template="{observation} {other}")


def test_single_turn_and_the_stop_strings_of_both_tools(python_env):
    assert isinstance(make_environment(EnvConfig()), SingleTurn)
    assert python_env.stop == ("</tool_call>",)
    both = make_environment(EnvConfig(type="tools", tools=["python", "calculator"]))
    assert both.stop == ("</tool_call>", "</calc>")
    assert both.step("<calc>6*7</calc>").observation == "<result>42</result>"


def hermes(payload: str) -> str:
    return f"I will run it.\n<tool_call>\n{payload}\n</tool_call>"


def test_hermes_call_parses_as_vllm_reads_it():
    code = "import math\nprint(math.factorial(5))"
    payload = json.dumps({"name": "python", "arguments": {"code": code}})
    assert parse_call(f"\n{payload}\n") == code
    assert parse_call('{"arguments": {"code": "print(1)"}, "name": "python", "id": 3}') == "print(1)"


@pytest.mark.parametrize("payload, message", [
    ('{"name": "python", "arguments": {"code": "print(1)"}', "not valid JSON"),
    ('{"name": "python", "arguments": {"code": "print(1)\nprint(2)"}}', "not valid JSON"),  # a raw newline
    ("print(1)", "not valid JSON"),
    ('["python"]', 'a tool call is {"name"'),
    ('{"arguments": {"code": "print(1)"}}', 'a tool call is {"name"'),
    ('{"name": "search", "arguments": {"query": "x"}}', "unknown tool 'search'; the tools are: python"),
    ('{"name": "python", "arguments": {}}', 'takes {"code"'),
    ('{"name": "python", "arguments": "print(1)"}', 'takes {"code"'),
    ('{"name": "python", "arguments": {"code": 5}}', 'takes {"code"'),
    ('{"name": "python", "arguments": {"code": "  "}}', "the code is empty"),
])
def test_malformed_hermes_calls_tell_the_model_what_was_wrong(python_env, payload, message):
    with pytest.raises(CallError, match=message.replace("(", r"\(").replace("{", r"\{")):
        parse_call(payload)
    reply = python_env.step(hermes(payload))
    assert reply.tool_call and reply.tool_error
    start, end = CHATML.split("{observation}")
    assert reply.observation.startswith(start + "<tool_response>\nerror: ")
    assert reply.observation.endswith("\n</tool_response>" + end)
    assert message in reply.observation


def test_a_closing_tag_without_an_opening_one_is_an_error(python_env):
    reply = python_env.step('{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert reply.tool_error and "</tool_call> without <tool_call>" in reply.observation


@pytest.mark.parametrize("turn", ["The answer is \\boxed{4}.", "", "<tool_call>\n{\"name\": \"python\"",
                                  "<tool_call></tool_call> and then \\boxed{1}", "<calc>1+1</calc>"])
def test_text_without_a_python_call_ends_the_episode(python_env, turn):
    assert python_env.step(turn) == Reply(None)
