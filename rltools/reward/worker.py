"""A reward worker process: `python -m rltools.reward.worker MODULE:FUNCTION READ_FD WRITE_FD [batched]`.

Started by TimeoutPool (rltools/reward/pool.py) as a fresh interpreter, so it inherits neither the
generator's threads and vLLM state nor the caller's __main__ module. Protocol over two pipes of
pickled messages: it sends ("ready", None) or ("error", why) once, then answers each (args, kwargs)
call with ("ok", a float or a dict of named floats), ("raised", why) or ("not a number", what it
returned instead: None, a list, nan, inf); a batched function's call is answered with ("batch", one
such reply per completion) or ("not a number", why the list is not one). The pool's warm-up call,
if any, is the first call.

A call passes the function only the keywords it declares (all of them to a **kwargs), so
`f(completion, answer)` keeps working while the row's prompt and columns travel with every call. An
async function's coroutine is run on the worker's one event loop (its clients live across calls).
"""

import asyncio
import importlib
import inspect
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


def declared_keywords(function) -> set[str] | None:
    """The keyword names `function` takes besides its first two (completion, answer); None: any (**kwargs)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: positional only
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return keyword - {p.name for p in positional[:2]}


def serve(reference: str, requests: Connection, replies: Connection, batched: bool = False) -> None:
    try:
        function = load_function(reference)
        accepted = declared_keywords(function)
    except Exception as err:  # reported to the parent, which raises it with the reference named
        replies.send(("error", f"{type(err).__name__}: {err}"))
        return
    replies.send(("ready", None))
    loop = asyncio.new_event_loop()
    while True:
        try:
            args, kwargs = requests.recv()
        except EOFError:  # the pool closed its end
            return
        if accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        try:
            value = function(*args, **kwargs)
            if inspect.isawaitable(value):
                value = loop.run_until_complete(value)
        except Exception as err:
            replies.send(("raised", f"{type(err).__name__}: {err}"))
            continue
        replies.send(as_batch(value, len(args[0])) if batched else as_reward(value))


def as_reward(value) -> tuple[str, object]:
    """("ok", the float) for what float() takes (ints, bools, numpy and torch scalars) when it is
    finite: an infinite reward would make every advantage of its group nan; ("ok", {name: float})
    for a dict of such numbers by name. Else ("not a number", why)."""
    if isinstance(value, dict):
        scores = {}
        for name, item in value.items():
            number = _finite(item)
            if not isinstance(name, str) or number is None:
                return "not a number", f"returned {_short(repr(value))}: a dict needs names mapped to finite numbers"
            scores[name] = number
        return ("ok", scores) if scores else ("not a number", "returned an empty dict")
    number = _finite(value)
    if number is None:
        return "not a number", f"returned {_short(repr(value))}, not a finite number"
    return "ok", number


def as_batch(values, count: int) -> tuple[str, object]:
    """A batched function's list, one reply per completion; ("not a number", why) if it is no such list."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != count:
        what = f"{len(values)} values" if hasattr(values, "__len__") else _short(repr(values))
        return "not a number", f"returned {what} for {count} completions: a batched function returns one score each"
    return "batch", [as_reward(value) for value in values]


def _finite(value) -> float | None:
    try:
        number = float(value)
    except Exception:  # TypeError, ValueError ('yes'), OverflowError (10**400), a __float__ of the user's
        return None
    return number if math.isfinite(number) else None


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    serve(sys.argv[1], Connection(int(sys.argv[2]), writable=False), Connection(int(sys.argv[3]), readable=False),
          batched=sys.argv[4:] == ["batched"])
