"""Episodes: every sample as model turns and environment answers, sampled without lockstep.

A group's first turn is one vLLM request of n samples, exactly as LLM.generate would send it; each
later turn of a sample is a request of its own (n = 1) whose prompt is the problem's tokens followed
by the sample's tokens so far. The engine is stepped directly, so when a turn ends at a tool call the
environment answers on a worker thread while the engine keeps generating the others (a tool call of
one sample never holds up the batch; a group's first turns finish together). A single-turn
environment ends every episode after its first turn: the same path, one turn.

Invariants:
- Turn 0 of the group is the n-sample request LLM.generate would send for the problem's prompt tokens
  (vLLM seeds its sample j with `seed + j`): single-turn sampling is one request, token for token.
  Later turns' seeds are derived from (seed + j, turn), so a restarted generator regenerates them.
- Tokens are never re-tokenized: a turn's tokens are vLLM's; an observation is tokenized once
  (no special tokens) and appended with mask 0 and logprob 0.
- `generator.max_new_tokens` bounds all of a sample's completion tokens (turns and observations);
  a sample that reaches it ends with finish reason LENGTH. `env.max_turns` bounds its model turns:
  the last allowed turn is final even if it calls a tool.
- The episode's reward text is its last model turn.
- The engine is reached only through `VLLMEngine`'s small interface (`submit`, `step`, `abort`,
  `tokenizer`): this module imports no vLLM.
"""

import concurrent.futures as futures
import itertools
from dataclasses import dataclass, field

import numpy as np

from ..config.schema import EnvConfig
from ..envs import Environment, make_environment
from ..rollout import FinishReason, Sample

SEED_MOD = 2**31 - 1  # vLLM takes 31-bit seeds (request_seed in vllm_engine reduces by it too)
TOOL_GRACE_S = 60  # beyond env.tool_timeout_s before a tool that does not return stops the generator
_ids = itertools.count()
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True)
class Turn:
    """One completion of a finished request, as plain data."""

    token_ids: list[int]
    logprobs: list[float]
    """The sampled tokens' processed log-probabilities (after temperature)."""
    text: str
    finish_reason: str
    """vLLM's: "stop", "length" or "abort"."""
    stop_string: str | None = None
    """The stop string that ended it (a tool call's closing tag), if one did."""
    routed_experts: object = None
    """With routing replay: the experts vLLM routed each token to, [tokens, layers, top-k]."""


@dataclass(frozen=True)
class TurnOutput:
    request_id: str
    prompt_token_ids: list[int]
    turns: list[Turn]
    """In sample order."""


@dataclass
class Episode:
    """One sample in progress, then done."""

    prompt: str | list[int]
    """The problem's prompt tokens (`Problem.prompt_ids`), or its text until vLLM tokenized it at turn 0."""
    seed: int
    environment: Environment
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    last_turn: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    routed_experts: np.ndarray | None = None
    sampling: dict = field(default_factory=dict)
    """temperature / top_p of its requests (an eval set's); empty: the engine's."""

    def sample(self, reward: float, group_id: int, index: int, multi_turn: bool = False, **scored) -> Sample:
        """The finished episode as the rollout's sample; `multi_turn`: with which tokens the model
        wrote (the mask) and its tool counts; `scored`: how its reward came about (Sample's
        reward_failed, scores, failed_functions: rltools.reward.failures.Scores.outcome)."""
        turns = {"completion_mask": self.mask, "turns": self.turns, "tool_calls": self.tool_calls,
                 "tool_errors": self.tool_errors} if multi_turn else {}
        return Sample(prompt_ids=self.prompt, completion_ids=self.token_ids, completion_logprobs=self.logprobs,
                      reward=reward, group_id=group_id, sample_index=index, finish_reason=self.finish_reason,
                      text=self.last_turn, routed_experts=self.routed_experts, **scored, **turns)


def run_episodes(engine, problems: list, n: int, seeds: list[int], env: EnvConfig, max_tokens: int,
                 sampling: dict | None = None) -> list[list[Episode]]:
    """`n` episodes per problem (problem i's seeds `seeds[i]` .. + n - 1), each to its end; returns
    them grouped by problem, in sample order. `sampling`: temperature / top_p for every turn's request
    (default: the engine's)."""
    tokenizer = engine.tokenizer
    groups = []
    for problem, seed in zip(problems, seeds):
        environments = [make_environment(env) for _ in range(n)]  # one per episode: it may hold state
        for e in environments:
            e.reset(problem)
        prompt = list(problem.prompt_ids) if problem.prompt_ids is not None else problem.prompt
        groups.append([Episode(prompt, seed + j, e, sampling=sampling or {}) for j, e in enumerate(environments)])
    running: dict[str, list[Episode]] = {}  # request -> its episodes (a group's n at turn 0, then one)
    waiting: dict[futures.Future, Episode] = {}
    workers = futures.ThreadPoolExecutor(max_workers=max(1, min(32, n * len(problems))),
                                         thread_name_prefix="rltools-env")
    try:
        for group in groups:
            _start_turn(engine, group, max_tokens, running)
        while running or waiting:
            if running:
                for output in engine.step():
                    episodes = running.pop(output.request_id)
                    for episode, turn in zip(episodes, output.turns):
                        if _end_turn(engine, episode, output.prompt_token_ids, turn, env, max_tokens):
                            waiting[workers.submit(episode.environment.step, episode.last_turn)] = episode
            else:  # nothing to generate until a tool answers. Calls queued behind others finish one by
                # one, each within its deadline: no progress for a whole deadline means a tool ignores it
                done, _ = futures.wait(waiting, timeout=env.tool_timeout_s + TOOL_GRACE_S,
                                       return_when=futures.FIRST_COMPLETED)
                if not done:
                    raise RuntimeError(f"none of {len(waiting)} tool call(s) of env.tools {env.tools} returned within "
                                       f"env.tool_timeout_s {env.tool_timeout_s:g} s + {TOOL_GRACE_S} s: a tool "
                                       "ignores its deadline (see the generator log); fix the tool")
            for done in [f for f in waiting if f.done()]:
                episode = waiting.pop(done)
                _answer(engine, episode, done.result(), max_tokens, tokenizer, running)
    finally:
        if running:
            engine.abort(list(running))
        workers.shutdown(wait=True, cancel_futures=True)
        for episode in (e for group in groups for e in group):
            episode.environment.close()
    return groups


def _start_turn(engine, episodes: list[Episode], max_tokens: int, running: dict) -> None:
    """One request for the next turn of `episodes`: a whole group's first turn (n samples, as
    LLM.generate would send it), or one episode's later turn."""
    first = episodes[0]
    budget = max_tokens - len(first.token_ids)
    if budget <= 0:
        first.finish_reason = FinishReason.LENGTH
        return
    seed = first.seed if first.turns == 0 else (first.seed * 1_000_003 + first.turns) % SEED_MOD
    # Turn 0 hands vLLM the prompt's tokens (or a text, tokenized as LLM.generate does); later turns the
    # exact tokens so far.
    prompt = first.prompt if first.turns == 0 else first.prompt + first.token_ids
    request_id = f"rltools-{next(_ids)}"
    engine.submit(request_id, prompt, n=len(episodes), seed=seed, max_tokens=budget,
                  stop=list(first.environment.stop) or None, **first.sampling)
    running[request_id] = episodes


def _end_turn(engine, episode: Episode, prompt_ids, c: Turn, env: EnvConfig, max_tokens: int) -> bool:
    """Record a finished turn (`c`, one completion of the request); True when the environment is to
    answer it."""
    if episode.turns == 0:
        episode.prompt = list(prompt_ids)
    episode.token_ids += c.token_ids
    episode.logprobs += c.logprobs
    episode.mask += [1] * len(c.token_ids)
    episode.last_turn = c.text
    episode.turns += 1
    episode.finish_reason = _FINISH.get(c.finish_reason, FinishReason.ABORT)
    if engine.moe_layers is not None and episode.turns == 1:
        episode.routed_experts = _moe_routes(c.routed_experts, len(episode.prompt), len(c.token_ids),
                                             engine.moe_layers)
    ends_at_call = c.finish_reason == "stop" and c.stop_string is not None
    return ends_at_call and episode.turns < env.max_turns and len(episode.token_ids) < max_tokens


def _answer(engine, episode: Episode, reply, max_tokens: int, tokenizer, running: dict) -> None:
    """The environment's reply to the last turn: the episode ends, or goes on after the observation."""
    episode.tool_calls += reply.tool_call
    episode.tool_errors += reply.tool_error
    if reply.observation is None:
        return
    tokens = tokenizer.encode(reply.observation, add_special_tokens=False)
    room = max_tokens - len(episode.token_ids)
    episode.token_ids += tokens[:room]
    episode.logprobs += [0.0] * len(tokens[:room])
    episode.mask += [0] * len(tokens[:room])
    if len(tokens) >= room:  # no room left for the model to answer
        episode.finish_reason = FinishReason.LENGTH
        return
    _start_turn(engine, [episode], max_tokens, running)


def _moe_routes(routes, prompt_len: int, completion_len: int, moe_layers: list[int]) -> np.ndarray:
    """vLLM's routed experts of one sequence as the rollout stores them: a row for every token the
    model ran (prompt + completion - 1), a column for every MoE layer."""
    rows = prompt_len + completion_len - 1
    routes = np.asarray(routes)
    if routes.ndim != 3 or routes.shape[0] < rows:
        raise RuntimeError(f"routing replay: vLLM returned routed experts of shape {routes.shape} for a sequence of "
                           f"{prompt_len} prompt and {completion_len} completion tokens")
    if routes.shape[1] != len(moe_layers):  # one column per layer, dense layers included
        routes = routes[:, moe_layers]
    return routes[:rows].astype(np.int16)
