"""A reward worker process: `python -m rltools.reward.worker MODULE:FUNCTION READ_FD WRITE_FD`.

Started by TimeoutPool (rltools/reward/pool.py) as a fresh interpreter, so it inherits neither the
generator's threads and vLLM state nor the caller's __main__ module. Protocol over two pipes of
pickled messages: it sends ("ready", None) or ("error", why) once, then answers each args tuple with
("ok", float), ("raised", why) or ("not a number", what it returned instead: None, a list, nan, inf).
The pool's warm-up call, if any, is the first such tuple.
"""

import importlib
import math
import sys
from multiprocessing.connection import Connection


def load_function(reference: str):
    """The callable named by 'package.module:function'; ValueError naming what is missing."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {reference!r}")
    module = importlib.import_module(module_name)
    try:
        function = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(function):
        raise ValueError(f"{reference!r} is not callable")
    return function


def serve(reference: str, requests: Connection, replies: Connection) -> None:
    try:
        function = load_function(reference)
    except Exception as err:  # reported to the parent, which raises it with the reference named
        replies.send(("error", f"{type(err).__name__}: {err}"))
        return
    replies.send(("ready", None))
    while True:
        try:
            args = requests.recv()
        except EOFError:  # the pool closed its end
            return
        try:
            value = function(*args)
        except Exception as err:
            replies.send(("raised", f"{type(err).__name__}: {err}"))
            continue
        replies.send(as_reward(value))


def as_reward(value) -> tuple[str, object]:
    """("ok", the float) for what float() takes (ints, bools, numpy and torch scalars) when it is
    finite: an infinite reward would make every advantage of its group nan. Else ("not a number", why)."""
    try:
        number = float(value)
    except Exception:  # TypeError, ValueError ('yes'), OverflowError (10**400), a __float__ of the user's
        number = None
    if number is None or not math.isfinite(number):
        return "not a number", f"returned {_short(repr(value))}, not a finite number"
    return "ok", number


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    serve(sys.argv[1], Connection(int(sys.argv[2]), writable=False), Connection(int(sys.argv[3]), readable=False))
