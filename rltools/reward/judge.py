"""The judge (a reward function of type judge): a model that grades completions, served by vLLM on the
judge component's engines (`rltools.generate.judge`), asked over HTTP by the generators.

The wire, both ends of it here: POST / with {"prompts": [text, ...]} and the body's HMAC-SHA256 under
the run's secret in the X-Rltools-Mac header (a judge listens on the cluster's network: only the run's
own processes may use it); the reply {"texts": [...]}, one per prompt, in order. `JudgeServer` is what
the judge role puts around its engine, `JudgeClient` what a generator asks through.

Invariants:
- A scoring batch is split across the judge engines that are up; an engine that cannot be reached
  (connection refused, reset, closed before its reply) is lost for the rest of the attempt and its
  share goes to the others, as a lost generator engine's slots go to the other engines. With none
  left, JudgeLost ends the generator, unrestarted (the run then stops, or requeues after steps were
  trained, as when every generator engine is gone; a new start of the job starts new judges).
- reward.judge.timeout_s is the batch's deadline: calls still without a reply then time out. A reply
  without a score in 0..score_max (`score_pattern`), or a template that fails on a row, is a failed
  call. All of them score 0 and are counted and judged as any reward function's failures are.
"""

import hashlib
import hmac
import http.client
import json
import logging
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from ..config.schema import JudgeConfig
from ..errors import UserError
from .failures import ERROR, NOT_A_NUMBER, TIMEOUT, FailureLimit, RewardFailures, Scores
from .scorer import Call, Scorer

log = logging.getLogger("rltools.reward")

MAC_HEADER = "X-Rltools-Mac"
START_POLL_S = 1.0
Endpoint = tuple[str, int]


class JudgeLost(RuntimeError):
    """No judge engine is left to ask (or none started in reward.judge.start_timeout_s): the generator ends
    with `exit_code`, which its supervisor does not restart (a new engine would find no judge either)."""

    exit_code = 4


def mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


class JudgeServer:
    """HTTP on `host`, an ephemeral port: each request's prompts are answered by `complete(prompts) -> texts`,
    one request at a time (the engine batches within one)."""

    def __init__(self, complete: Callable[[list[str]], list[str]], secret: bytes, host: str):
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not hmac.compare_digest(mac(secret, body), self.headers.get(MAC_HEADER, "")):
                    log.warning("judge: refused a request from %s: its MAC does not match this run's secret",
                                self.client_address[0])
                    return self._reply(403, {"error": "the request's MAC does not match this run's secret"})
                try:
                    prompts = json.loads(body)["prompts"]
                    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                        raise ValueError("prompts must be a list of strings")
                except (ValueError, KeyError, TypeError) as err:
                    return self._reply(400, {"error": f"bad request: {err}"})
                try:
                    with lock:
                        texts = complete(prompts)
                except Exception as err:  # the engine's error goes back to the caller, whose calls fail with it
                    log.exception("judge: a batch of %d prompts failed", len(prompts))
                    return self._reply(500, {"error": f"{type(err).__name__}: {err}"})
                self._reply(200, {"texts": texts})

            def _reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the caller gave up (its deadline passed) or died: nobody to tell
                    log.info("judge: a caller left before its reply of %d bytes", len(data))

            def log_message(self, format, *args) -> None:  # one line per request would flood the log
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True

    @property
    def address(self) -> Endpoint:
        return self.httpd.server_address[:2]

    def serve_forever(self) -> None:
        """Until `stop` (from another thread)."""
        self.httpd.serve_forever(poll_interval=0.5)

    def stop(self) -> None:
        self.httpd.shutdown()

    def close(self) -> None:
        self.httpd.server_close()


class Unreachable(OSError):
    """The engine could not be reached, or closed the connection before its reply: it is gone."""


class JudgeClient:
    """A generator's way to the judge engines: `find()` gives the engines published for this attempt
    ({engine: (host, port)}); engines this client lost stay lost."""

    def __init__(self, find: Callable[[], dict[int, Endpoint]], secret: bytes, start_timeout_s: float):
        self.find, self.secret, self.start_timeout_s = find, secret, start_timeout_s
        self.lost: dict[int, str] = {}
        self.started = False

    def live(self) -> dict[int, Endpoint]:
        """The engines to ask now; the first time, waits up to start_timeout_s for one to come up."""
        deadline = time.monotonic() + (0 if self.started else self.start_timeout_s)
        said = False
        while True:
            found = {engine: at for engine, at in self.find().items() if engine not in self.lost}
            if found:
                self.started = True
                return found
            if self.lost:
                raise JudgeLost("every judge engine is gone: " + "; ".join(
                    f"judge {engine}: {why}" for engine, why in sorted(self.lost.items())))
            if time.monotonic() >= deadline:
                raise JudgeLost(f"no judge engine came up within reward.judge.start_timeout_s "
                                f"({self.start_timeout_s:.0f} s): see the judge logs (rltools logs RUN --role judge)")
            if not said:
                log.info("waiting for the judge engines to start (reward.judge)")
                said = True
            time.sleep(START_POLL_S)

    def complete(self, prompts: list[str], timeout_s: float) -> tuple[list[str | None], dict[int, tuple[str, str]]]:
        """The judge's reply to each prompt (None where it failed) and {index: (kind, message)} of the failures."""
        deadline = time.monotonic() + timeout_s
        texts: list[str | None] = [None] * len(prompts)
        failed: dict[int, tuple[str, str]] = {}
        todo = list(range(len(prompts)))
        while todo:
            engines = self.live()
            if time.monotonic() >= deadline:
                failed.update({i: (TIMEOUT, f"no reply within reward.judge.timeout_s ({timeout_s:g} s)") for i in todo})
                break
            shares = {engine: todo[k::len(engines)] for k, engine in enumerate(sorted(engines))}
            shares = {engine: share for engine, share in shares.items() if share}
            with ThreadPoolExecutor(len(shares)) as pool:
                replies = {engine: pool.submit(self._post, engines[engine], [prompts[i] for i in share], deadline)
                           for engine, share in shares.items()}
            todo = []
            for engine, future in replies.items():
                share = shares[engine]
                try:
                    for i, text in zip(share, future.result(), strict=True):
                        texts[i] = text
                except JudgeLost:
                    raise
                except Unreachable as err:
                    self.lost[engine] = str(err)
                    log.warning("judge %d is lost (%s): its %d prompt(s) go to the other judge engines", engine, err,
                                len(share))
                    todo += share
                except TimeoutError:
                    failed.update({i: (TIMEOUT, f"judge {engine} gave no reply within reward.judge.timeout_s "
                                                f"({timeout_s:g} s)") for i in share})
                except (RuntimeError, ValueError) as err:
                    failed.update({i: (ERROR, f"judge {engine}: {err}") for i in share})
            todo.sort()
        return texts, failed

    def _post(self, at: Endpoint, prompts: list[str], deadline: float) -> list[str]:
        body = json.dumps({"prompts": prompts}).encode()
        connection = http.client.HTTPConnection(*at, timeout=max(0.1, deadline - time.monotonic()))
        try:
            connection.request("POST", "/", body, {"Content-Type": "application/json", MAC_HEADER: mac(self.secret, body)})
            response = connection.getresponse()
            data = response.read()
        except TimeoutError:
            raise
        except (OSError, http.client.HTTPException) as err:  # refused, reset, closed before the reply
            raise Unreachable(f"{at[0]}:{at[1]}: {err or type(err).__name__}") from None
        finally:
            connection.close()
        try:
            payload = json.loads(data)
        except ValueError:
            raise ValueError(f"an unreadable reply (HTTP {response.status})") from None
        if response.status == 403:
            raise JudgeLost(f"judge at {at[0]}:{at[1]} refused this generator: {payload.get('error')} (a judge of "
                            "another run directory?)")
        if response.status != 200:
            raise RuntimeError(payload.get("error", f"HTTP {response.status}"))
        texts = payload.get("texts")
        if not isinstance(texts, list) or len(texts) != len(prompts):
            raise ValueError(f"a reply of {len(texts) if isinstance(texts, list) else 'no'} texts for {len(prompts)} prompts")
        return texts


class JudgeScorer(Scorer):
    """Renders reward.judge.template for each call, asks the judge engines (`connect` gives the client:
    only a process of the run's job has one) and reads each reply's score."""

    def __init__(self, config: JudgeConfig):
        from jinja2 import StrictUndefined
        from jinja2.sandbox import SandboxedEnvironment

        self.config = config
        self.template = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(
            config.template)
        self.pattern = re.compile(config.score_pattern)
        self.client: JudgeClient | None = None

    def render(self, call: Call) -> str:
        prompt = call.prompt
        messages = prompt if isinstance(prompt, list) else None
        text = "\n\n".join(str(m.get("content", "")) for m in messages) if messages is not None else prompt
        return self.template.render({**call.columns, "prompt": text, "messages": messages,
                                     "completion": call.completion, "answer": call.answer})

    def score(self, reply: str) -> float:
        """The reply's last match of score_pattern over score_max; ValueError when there is none in range."""
        matches = self.pattern.findall(reply)
        if not matches:
            raise ValueError(f"no score in the judge's reply (reward.judge.score_pattern): {reply[-200:]!r}")
        found = matches[-1][0] if isinstance(matches[-1], tuple) else matches[-1]
        try:
            value = float(found)
        except ValueError:
            raise ValueError(f"the judge's score {found!r} is not a number") from None
        if not (math.isfinite(value) and 0 <= value <= self.config.score_max):
            raise ValueError(f"the judge's score {found} is outside 0..{self.config.score_max:g} (reward.judge.score_max)")
        return value / self.config.score_max

    def results(self, calls: list[Call], limit: FailureLimit) -> Scores:
        if self.client is None:
            raise UserError("a reward function of type judge is scored by the run's judge engines (cluster.judges), "
                            "which only the run's own job has: score these completions with another verifier")
        values, failures = [0.0] * len(calls), RewardFailures(calls=len(calls))
        prompts: dict[int, str] = {}
        for i, call in enumerate(calls):
            try:
                prompts[i] = self.render(call)
            except Exception as err:  # a column the template names and the row lacks, a filter that raised
                failures.add(i, ERROR, f"reward.judge.template failed: {err}")
        order = list(prompts)
        texts, failed = self.client.complete([prompts[i] for i in order], self.config.timeout_s)
        for k, i in enumerate(order):
            if k in failed:
                failures.add(i, *failed[k])
                continue
            try:
                values[i] = self.score(texts[k])
            except ValueError as err:
                failures.add(i, NOT_A_NUMBER, str(err))
        return Scores(values, failures)
