"""The python tool through the real sandbox: a Hermes-style call runs and its output comes back in a
`<tool_response>`; failures (an exception, a timeout) are tool errors the model reads.

Without bwrap these tests skip for an ordinary user and fail for root, as tests/integration/test_sandbox.py.
"""

import json
import os
import threading

import pytest

from rltools.config.schema import EnvConfig
from rltools.envs import Reply, make_environment
from rltools.envs.python_tool import _POOLS, close_pools
from rltools.errors import UserError
from rltools.sandbox.host import check_host


@pytest.fixture(scope="module", autouse=True)
def bwrap():
    try:
        check_host()
    except UserError as err:
        if os.geteuid() == 0:
            pytest.fail(f"root runs scripts/setup.sh, which installs bubblewrap, so this is a failure: {err}")
        pytest.skip(str(err))
    yield
    close_pools()


def python_env(**fields):
    return make_environment(EnvConfig(type="tools", tools=["python"], **fields))


def call(code: str) -> str:
    payload = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"Let me compute it.\n<tool_call>\n{payload}\n</tool_call>"


def test_a_call_returns_what_the_program_printed():
    env = python_env()
    assert env.step(call("print(2**10)")) == Reply("<tool_response>\n1024\n</tool_response>", True, False)
    assert env.step(call("x = 1")).observation == "<tool_response>\n(no output)\n</tool_response>"
    chatml = "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    reply = python_env(observation_template=chatml).step(call("import sys\nprint('out')\nprint('err', file=sys.stderr)"))
    assert reply.observation == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nout\nerr\n</tool_response>"
                                 "<|im_end|>\n<|im_start|>assistant\n")
    env.close()


def test_an_exception_returns_its_traceback_tail():
    reply = python_env(tool_output_chars=60).step(call("def f(n):\n    return 1 / n\n\nprint('before')\nf(0)"))
    assert reply.tool_call and reply.tool_error
    lines = reply.observation.splitlines()
    assert lines[0] == "<tool_response>" and lines[-1] == "</tool_response>"
    assert lines[1].startswith("[output cut: the last 60 of ")
    assert lines[-2] == "ZeroDivisionError: division by zero"
    whole = python_env().step(call("print('before')\nraise ValueError('bad value')")).observation
    assert whole.startswith("<tool_response>\nbefore\nTraceback (most recent call last):\n")
    assert whole.endswith("ValueError: bad value\n</tool_response>")


def test_a_timeout_is_a_tool_error():
    reply = python_env(tool_timeout_s=1).step(call("import time\nprint('started', flush=True)\ntime.sleep(30)"))
    assert reply == Reply("<tool_response>\nstarted\nerror: the program ran past 1 s and was stopped\n</tool_response>",
                          True, True)
    spin = python_env(tool_timeout_s=1).step(call("while True:\n    pass"))
    assert spin.tool_error and "ran past 1 s" in spin.observation


def test_output_is_cut_at_tool_output_chars():
    reply = python_env(tool_output_chars=100).step(call("for i in range(1000):\n    print(i)"))
    assert not reply.tool_error
    expected = "\n".join(str(i) for i in range(1000))[:100]
    assert reply.observation == (f"<tool_response>\n{expected}\n[output cut: the first 100 of 3889 characters]\n"
                                 "</tool_response>")
    exited = python_env().step(call("import sys\nsys.exit(3)"))
    assert exited == Reply("<tool_response>\nerror: the program exited with code 3\n</tool_response>", True, True)


def test_environments_of_concurrent_episodes_share_one_pool():
    envs = [python_env(tool_timeout_s=5) for _ in range(6)]
    replies = [None] * len(envs)

    def episode(i):
        replies[i] = envs[i].step(call(f"print({i} * 7)"))

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(envs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [r.observation for r in replies] == [f"<tool_response>\n{i * 7}\n</tool_response>" for i in range(6)]
    assert sum(pool.limits.timeout_s == 5 for pool in _POOLS.values()) == 1
    for env in envs:
        env.close()
    close_pools()
    assert _POOLS == {}
    assert envs[0].step(call("print(1)")).observation == "<tool_response>\n1\n</tool_response>"  # a fresh pool
