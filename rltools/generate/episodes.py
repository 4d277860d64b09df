"""Episodes: every sample as model turns and environment answers, sampled without lockstep.

Each sample's turn is one vLLM request (n = 1) whose prompt is the problem's tokens followed by the
sample's tokens so far; the engine is stepped directly, so when one sample's turn ends its
environment call runs on a worker thread while the engine keeps generating the others (a tool call
of one sample never holds up the batch). A single-turn environment ends every episode after its
first turn: the same path, one turn.

Invariants:
- Turn 0 of sample j uses seed `seed + j`, which is what vLLM gives sample j of an n-sample request
  (DESIGN.md): an episode of a single-turn environment samples exactly what `n` sampling did. Later
  turns' seeds are derived from (seed + j, turn), so a restarted generator regenerates them too.
- Tokens are never re-tokenized: a turn's tokens are vLLM's; an observation is tokenized once
  (no special tokens) and appended with mask 0 and logprob 0.
- `generator.max_new_tokens` bounds all of a sample's completion tokens (turns and observations);
  a sample that reaches it ends with finish reason LENGTH. `env.max_turns` bounds its model turns:
  the last allowed turn is final even if it calls a tool.
- The episode's reward text is its last model turn.
"""

import concurrent.futures as futures
import itertools
from dataclasses import dataclass, field

import numpy as np

from ..config.schema import EnvConfig
from ..envs import Environment, make_environment
from ..rollout import FinishReason

_SEED_MOD = 2**31 - 1
_ids = itertools.count()
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class Episode:
    """One sample in progress, then done."""

    prompt: str | list[int]
    """The first observation as text, then (after turn 0) its token ids as vLLM tokenized it."""
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


def run_episodes(engine, problems: list, n: int, seeds: list[int], env: EnvConfig, max_tokens: int) -> list[list[Episode]]:
    """`n` episodes per problem (problem i's seeds `seeds[i]` .. + n - 1), each to its end; returns
    them grouped by problem, in sample order."""
    llm = engine.llm
    tokenizer = llm.get_tokenizer()
    groups = []
    for problem, seed in zip(problems, seeds):
        environments = [make_environment(env) for _ in range(n)]  # one per episode: it may hold state
        groups.append([Episode(e.reset(problem), seed + j, e) for j, e in enumerate(environments)])
    running: dict[str, Episode] = {}
    waiting: dict[futures.Future, Episode] = {}
    workers = futures.ThreadPoolExecutor(max_workers=max(1, min(32, n * len(problems))),
                                         thread_name_prefix="rltools-env")
    try:
        for episode in (e for group in groups for e in group):
            _start_turn(engine, episode, max_tokens, running)
        while running or waiting:
            if running:
                for output in llm.llm_engine.step():
                    if output.finished:
                        episode = running.pop(output.request_id)
                        if _end_turn(engine, episode, output, env, max_tokens):
                            waiting[workers.submit(episode.environment.step, episode.last_turn)] = episode
            else:
                futures.wait(waiting, return_when=futures.FIRST_COMPLETED)
            for done in [f for f in waiting if f.done()]:
                episode = waiting.pop(done)
                _answer(engine, episode, done.result(), max_tokens, tokenizer, running)
    finally:
        if running:
            llm.llm_engine.abort_request(list(running))
        workers.shutdown(wait=True, cancel_futures=True)
        for episode in (e for group in groups for e in group):
            episode.environment.close()
    return groups


def _start_turn(engine, episode: Episode, max_tokens: int, running: dict) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    budget = max_tokens - len(episode.token_ids)
    if budget <= 0:
        episode.finish_reason = FinishReason.LENGTH
        return
    seed = episode.seed if episode.turns == 0 else (episode.seed * 1_000_003 + episode.turns) % _SEED_MOD
    params = SamplingParams(n=1, temperature=engine.config.temperature, top_p=engine.config.top_p, max_tokens=budget,
                            logprobs=0, seed=seed, stop=list(episode.environment.stop) or None,
                            include_stop_str_in_output=True, output_kind=RequestOutputKind.FINAL_ONLY)
    # Turn 0 hands vLLM the text, tokenized as LLM.generate does; later turns the exact tokens so far.
    # LLM.generate's own way in (render, then add to the engine), without its run-to-completion loop.
    prompt = episode.prompt if episode.turns == 0 else {"prompt_token_ids": episode.prompt + episode.token_ids}
    request_id = f"rltools-{next(_ids)}"
    engine.llm.llm_engine.add_request(request_id, engine.llm._preprocess_cmpl_one(prompt, None), params,
                                      lora_request=engine.lora_request)
    running[request_id] = episode


def _end_turn(engine, episode: Episode, output, env: EnvConfig, max_tokens: int) -> bool:
    """Record a finished turn; True when the environment is to answer it."""
    c = output.outputs[0]
    if episode.turns == 0:
        episode.prompt = list(output.prompt_token_ids)
    episode.token_ids += list(c.token_ids)
    episode.logprobs += [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
    episode.mask += [1] * len(c.token_ids)
    episode.last_turn = c.text
    episode.turns += 1
    episode.finish_reason = _FINISH.get(c.finish_reason, FinishReason.ABORT)
    if engine.moe_layers is not None and episode.turns == 1:
        episode.routed_experts = _moe_routes(c.routed_experts, len(episode.prompt), len(c.token_ids),
                                             engine.moe_layers)
    ends_at_call = c.finish_reason == "stop" and isinstance(c.stop_reason, str)
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
    _start_turn(engine, episode, max_tokens, running)


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
