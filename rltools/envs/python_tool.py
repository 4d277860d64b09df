"""The python tool: a Hermes-style tool call, as Qwen2.5/Qwen3 chat templates write it and vLLM's
`hermes` tool parser reads it, run in the sandbox; the answer in a `<tool_response>`.

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2**10)"}}
    </tool_call>
  ->
    <tool_response>
    1024
    </tool_response>

Invariants: nothing the model wrote raises (a malformed call is answered with what was wrong); the
program runs in a fresh sandbox from a pool shared by every environment of the process with the same
limits, so hundreds of concurrent episodes hold a few warm sandboxes, not hundreds. Sandboxes are
started and run only by this module's worker threads, which live as long as the process: bwrap ends a
sandbox when the thread that started it exits, so a short-lived caller's thread must not start one
that another call then runs. The pools close at process exit; a forked child starts with none.
"""

import atexit
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..sandbox import Limits, Result, SandboxPool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = "python"
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
POOL_SIZE = min(8, CPUS)
"""Warm sandboxes per pool: a call takes one and the pool starts its replacement meanwhile."""
MAX_RUNNING = CPUS
"""Programs running at once in the process (they are CPU-bound: one per CPU of the task); further
calls wait their turn."""


class CallError(ValueError):
    """The tool call cannot run; the message tells the model why."""


def parse_call(payload: str, tools: tuple[str, ...] = (NAME,)) -> str:
    """The code of a call, from the text between `<tool_call>` and `</tool_call>`.

    The payload is one JSON object {"name": ..., "arguments": {...}}, strict JSON as vLLM's hermes
    parser reads it: a newline inside the code is written \\n, not a raw line break.
    """
    try:
        call = json.loads(payload)
    except (json.JSONDecodeError, RecursionError) as err:
        raise CallError(f"the tool call is not valid JSON ({err})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise CallError('a tool call is {"name": "python", "arguments": {"code": "..."}}')
    if call["name"] not in tools:
        raise CallError(f"unknown tool {call['name'][:50]!r}; the tools are: {', '.join(tools)}")
    arguments = call.get("arguments")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        raise CallError('the python tool takes {"code": "<the program>"} as its arguments')
    if not arguments["code"].strip():
        raise CallError("the code is empty")
    return arguments["code"]


def limits_for(timeout_s: float) -> Limits:
    """The sandbox limits of one call: the wall clock is env.tool_timeout_s, CPU time the same."""
    return Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)))


def run_python(code: str, limits: Limits, output_chars: int) -> tuple[str, bool]:
    """(the `<tool_response>` text, whether the call failed) for one program."""
    result = _executor().submit(lambda: _pool(limits).run(code)).result()
    failed = result.exit_code != 0 or result.timed_out or result.truncated
    # stdout, then stderr; on a failure the end is kept (a traceback's last lines), else the start.
    text = cut(result.stdout + result.stderr, output_chars, keep_tail=failed)
    problem = failure(result, limits)
    if problem:
        text = f"{text}\nerror: {problem}" if text else f"error: {problem}"
    return f"<tool_response>\n{text or '(no output)'}\n</tool_response>", failed


def error_response(message: str) -> str:
    return f"<tool_response>\nerror: {message}\n</tool_response>"


def failure(result: Result, limits: Limits) -> str | None:
    """A line on how the program failed, where its own output may not say it (a traceback does)."""
    if result.timed_out:
        return f"the program ran past {limits.timeout_s:g} s and was stopped"
    if result.truncated:
        return f"the program printed more than {limits.output_bytes} bytes and was stopped"
    if result.exit_code != 0 and not result.stderr.strip():
        return f"the program exited with code {result.exit_code}"
    return None


def cut(text: str, chars: int, keep_tail: bool) -> str:
    """`text` whole, or `chars` of it and a note: its start, or its end (a traceback's last lines)."""
    text = text.rstrip("\n")
    if len(text) <= chars:
        return text
    if keep_tail:
        return f"[output cut: the last {chars} of {len(text)} characters]\n" + text[-chars:]
    return text[:chars] + f"\n[output cut: the first {chars} of {len(text)} characters]"


_POOLS: dict[Limits, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()
_EXECUTOR: list[ThreadPoolExecutor] = []


def _executor() -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(MAX_RUNNING, thread_name_prefix="python-tool"))
        return _EXECUTOR[0]


def _pool(limits: Limits) -> SandboxPool:
    with _POOLS_LOCK:
        if limits not in _POOLS:
            _POOLS[limits] = SandboxPool(POOL_SIZE, limits)
        return _POOLS[limits]


def close_pools() -> None:
    """Kill every warm sandbox of this process (at exit; tests call it too). A later call starts anew."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _forget_pools() -> None:
    global _POOLS_LOCK
    _POOLS.clear()  # the parent's sandboxes: killing them here would kill them for the parent too
    _EXECUTOR.clear()  # its threads did not survive the fork
    _POOLS_LOCK = threading.Lock()


atexit.register(close_pools)
os.register_at_fork(after_in_child=_forget_pools)
