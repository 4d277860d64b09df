"""Will the job fit on its GPUs? A memory estimate per trainer rank and per generator GPU, from the
model's config.json (and its safetensors headers) and the run config, against
`cluster.gpu_memory_gib`.

Invariant: light (no torch: `submit --dry-run` prints it on a login node). The formulas, their
sources, the published figures they are checked against and what they leave out: docs/memory.md.
Only a clear excess (more than MARGIN over the GPU) stops a submission; anything closer is a
warning, since an estimate is not a measurement.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..config.schema import RLConfig
from ..errors import UserError
from ..weight_formats import weight_format
from .model_size import (
    DTYPE_BYTES,
    Shape,
    Weights,
    lora_params,
    vllm_lora_bytes,
    weights_from_config,
    weights_from_headers,
)

GIB = 2**30
OVERHEAD = 2 * GIB  # per GPU (none counted on CPU): CUDA context (~0.5 GiB), cuBLAS/NCCL workspaces, allocator fragmentation
MARGIN = 0.10  # refuse a submission only when an estimate exceeds the GPU by more than this fraction
PROMPT_TOKENS = {"arithmetic": 32, "products": 48}  # assumed prompt length; problem files: DEFAULT_PROMPT_TOKENS
DEFAULT_PROMPT_TOKENS = 1024
LORA_STATE_BYTES = 16  # per LoRA parameter: float32 value, gradient and AdamW's two moments
VLLM_MAX_NUM_SEQS = (256, 1024)  # vLLM's default max_num_seqs for LLM(): 1024 on GPUs of >= 70 GiB


@dataclass
class Estimate:
    role: str
    parts: list[tuple[str, float]]  # (what, bytes), summed
    detail: str  # how the parts were computed, for the reader
    capacity: float | None  # bytes this role may use on one GPU; None: no verdict
    floor: float | None = None  # the least it needs to start (generator: one sequence of max_model_len)
    shortfall: str = ""  # what does not fit when total exceeds capacity but floor does not
    export: float = 0.0  # trainer: the peak while it gathers the weights to send them (no activations then)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)

    @property
    def need(self) -> float:
        return max(self.total, self.export) if self.floor is None else self.floor

    @property
    def over(self) -> float:
        """How far the estimate exceeds the GPU, as a fraction of it (<= 0: it fits)."""
        return (self.need - self.capacity) / self.capacity if self.capacity else 0.0

    def lines(self) -> list[str]:
        shown = ", ".join(f"{what} {size(b)}" for what, b in self.parts if b)
        lines = [f"    {self.role}: {size(self.total)} ({shown}; {self.detail})"]
        if self.export > self.total:
            lines.append(f"      weight export: {size(self.export)} (every trainer rank gathers the weights it sends, a layer at a time; "
                         "generator.weight_sync: lora sends only the adapter)")
        if self.capacity is None:
            return lines
        head, of = lines, f"of {size(self.capacity)}"
        peak = max(self.total, self.export)
        if peak <= self.capacity:
            return [*head, f"      {of}: fits with {size(self.capacity - peak)} spare"]
        if self.floor is not None and self.floor <= self.capacity:
            return [*head, f"      {of}: fits, but {self.shortfall}"]
        verdict = "does not fit" if self.over > MARGIN else "may not fit"
        return [*head, f"      {of}: {verdict}: {size(self.need)} needed, {self.over:.0%} over"]


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def estimate(config: RLConfig, model_config: dict) -> list[Estimate]:
    """The trainer rank's and the generator GPU's estimates."""
    shape = Shape.from_config(model_config)
    dtype = DTYPE_BYTES[config.model.dtype]
    quantize = config.model.quantization == "nvfp4"
    weights = (weights_from_headers(Path(config.model.path), shape, model_config, dtype, quantize)
               or weights_from_config(shape, model_config, dtype, quantize))
    prompt = PROMPT_TOKENS.get(config.data.type, DEFAULT_PROMPT_TOKENS)
    new = config.generator.max_new_tokens
    if shape.max_positions:  # vLLM cuts max_tokens so that prompt + completion fit max_model_len
        prompt = min(prompt, shape.max_positions - 1)
        new = min(new, shape.max_positions - prompt)
    trainer_weights = weights
    if quantize and config.trainer.backend == "megatron":  # it dequantises all but the routed experts at load
        plain = {k: v for k, v in model_config.items() if k != "quantization_config"}
        dense = weights_from_config(shape, plain, dtype, quantize=False)
        trainer_weights = replace(weights, total=dense.total - dense.experts + weights.experts,
                                  source=f"{weights.source}; outside the routed experts dequantised")
    return [trainer_estimate(config, shape, trainer_weights, prompt, new),
            generator_estimate(config, shape, weights, prompt, new)]


def trainer_estimate(config: RLConfig, shape: Shape, weights: Weights, prompt: int, new: int) -> Estimate:
    t, s, lora = config.trainer, config.schedule, config.lora
    ranks, dtype = config.cluster.trainers.ntasks, DTYPE_BYTES[config.model.dtype]
    megatron = t.backend == "megatron"
    if megatron:  # routed experts are whole on their EP rank (expert TP 1), never split over TP
        split = t.tensor_parallel * t.pipeline_parallel
        layers = weights.total - weights.outside_layers - weights.experts
        base = (layers / split + weights.experts / (t.pipeline_parallel * t.expert_parallel)
                + weights.outside_layers / t.tensor_parallel)
        gathered, dp, act_split = 0.0, ranks // split, t.tensor_parallel
        how = f"split TP {t.tensor_parallel} x PP {t.pipeline_parallel}" + (
            f", routed experts over EP {t.expert_parallel}" if weights.experts else "")
    else:  # FSDP2: the root (embeddings, head) stays gathered in forward and backward, and a layer is
        # prefetched while the previous one computes: two layers unsharded at a time
        split = dp = ranks
        base, act_split = weights.total / ranks, 1
        gathered = 0.0 if ranks == 1 else weights.outside_layers * (1 - 1 / ranks) + 2 * weights.largest_layer
        how = f"sharded 1/{ranks}" if ranks > 1 else "unsharded"
    if lora.enabled:
        state = ("LoRA+AdamW", lora_params(shape, lora.target_modules, lora.rank) * LORA_STATE_BYTES / split)
    else:  # gradients and AdamW's moments in the parameters' dtype
        state = ("grads+AdamW", weights.params * 3 * dtype / split)
    per_rank = s.prompts_per_step * s.group_size // max(dp, 1)
    micro = max(1, min(t.micro_batch_size, math.ceil(per_rank / config.algorithm.mini_batches)))
    # Megatron runs every sample's whole sequence (no shared prompt pass) and gathers the vocabulary
    group = 1 if megatron else s.group_size
    acts = activation_bytes(shape, micro, prompt, new, group, dtype, t.gradient_checkpointing,
                            cached=not megatron) / act_split
    logits = logits_bytes(shape, micro, prompt, new, group, dtype, config.generator.temperature, whole=megatron)
    logits /= 1 if megatron else act_split
    overhead = OVERHEAD if config.cluster.trainers.gpus_per_node else 0.0
    parts = [("base", base), ("gathered", gathered), state, ("activations", acts), ("logits", logits),
             ("overhead", overhead)]
    gc = "with" if t.gradient_checkpointing else "without"
    detail = (f"{count(weights.params)} params from {weights.source}, {how}; micro batch {micro} x "
              f"({prompt} prompt + {new} new) tokens, {gc} gradient checkpointing")
    # FSDP2 gathers the adapter whole (lora); full and adapted stream one group at a time (a layer
    # without its routed experts, one projection of them), whole and dequantised to model.dtype
    adapter_only = not weight_format(config).dense  # vLLM serves the adapter itself (weight_sync: lora)
    sent = lora_params(shape, lora.target_modules, lora.rank) * 4 if adapter_only else shape.largest_export_params() * dtype
    export = base + state[1] + sent + overhead if t.backend == "fsdp2" and ranks > 1 else 0.0
    return Estimate("trainer rank", parts, detail, _gpu(config, "trainers"), export=export)


def activation_bytes(shape: Shape, micro: int, prompt: int, new: int, group: int, dtype: int,
                     checkpointing: bool, cached: bool = True) -> float:
    """What the decoder layers keep for backward over one micro batch. The FSDP2 trainer runs each
    distinct prompt once and the completions on top of its cache, gathered to every sample
    (train/logprobs.py: `cached`); Megatron's runs each sample's whole sequence (group 1, no
    cache). With checkpointing a layer keeps only its input and its keys and values, and one layer
    at a time holds everything during its recompute."""
    tokens = math.ceil(micro / group) * prompt + micro * new
    gathered_cache = micro * prompt * shape.kv_elements(vllm=False) if cached else 0
    full_layer = tokens * shape.saved_elements() + gathered_cache
    if not checkpointing:
        return shape.layers * full_layer * dtype
    kept = tokens * (shape.hidden + shape.kv_elements(vllm=False)) + gathered_cache
    return (shape.layers * kept + full_layer) * dtype


def logits_bytes(shape: Shape, micro: int, prompt: int, new: int, group: int, dtype: int, temperature: float,
                 whole: bool = False) -> float:
    """Logits over the vocabulary: the prompts' (compute dtype), and per completion token the
    head's output and its concatenated copy (compute dtype), the float32 upcast and log_softmax's
    float32 output kept for backward (a third float32 copy when the temperature divides them).
    `whole` (Megatron): one head output over every position, whose completion part is a view."""
    fp32_copies = 2 + (temperature not in (0.0, 1.0))
    prompts = math.ceil(micro / group) * prompt * shape.vocab * dtype
    return prompts + micro * new * shape.vocab * ((1 if whole else 2) * dtype + 4 * fp32_copies)


def generator_estimate(config: RLConfig, shape: Shape, weights: Weights, prompt: int, new: int) -> Estimate:
    g, s, gens = config.generator, config.schedule, config.cluster.generators
    tp, dtype = g.tensor_parallel_size, DTYPE_BYTES[config.model.dtype]
    gpu = _gpu(config, "generators")
    if shape.mla:  # the latent is replicated on every TP rank
        per_layer = shape.kv_elements(vllm=True)
    else:  # KV heads are split over TP ranks (replicated when fewer than the ranks)
        per_layer = 2 * math.ceil(shape.kv_heads / tp) * shape.head_dim
    per_token = shape.layers * per_layer * dtype
    max_seqs = VLLM_MAX_NUM_SEQS[bool(gpu and gpu >= 70 * GIB)]
    seqs = min(math.ceil(s.prompts_per_step / gens.ntasks) * s.group_size, max_seqs)
    seq_len = prompt + new
    kv = seqs * seq_len * per_token if g.kv_cache_memory_bytes is None else g.kv_cache_memory_bytes
    lora = _vllm_lora(config, shape)
    sampler = max_seqs * shape.vocab * 4 * 2  # float32 logits and probabilities of a full batch
    overhead = OVERHEAD + sampler if gens.gpus_per_node else sampler
    parts = [("weights", weights.total / tp), ("LoRA", lora), ("KV cache", kv), ("overhead", overhead)]
    capacity = gpu * g.gpu_memory_utilization if gpu else None
    model_len = shape.max_positions or seq_len  # vLLM refuses to start without room for one such sequence
    floor = weights.total / tp + lora + overhead + model_len * per_token
    room = int((capacity - (floor - model_len * per_token)) // (seq_len * per_token)) if capacity else 0
    detail = (f"TP {tp}; {seqs} sequences x {seq_len} tokens at {per_token / 1024:.1f} KiB/token"
              + (f" (max_num_seqs {max_seqs})" if seqs == max_seqs else ""))
    shortfall = (f"the KV cache holds ~{room} of {seqs} sequences of {seq_len} tokens at once: vLLM queues the rest "
                 "(slower, not an error)")
    role = f"generator GPU ({g.gpu_memory_utilization:.0%} of it: gpu_memory_utilization)" if gpu else "generator"
    return Estimate(role, parts, detail, capacity, floor, shortfall)


def _vllm_lora(config: RLConfig, shape: Shape) -> float:
    """vLLM's LoRA buffers on one generator GPU, for the engine arguments the run's weight format
    starts it with (weight_sync: lora; none for the formats that load merged weights)."""
    args = weight_format(config).engine_args()
    if not args.get("enable_lora"):
        return 0.0
    return vllm_lora_bytes(shape, args["lora_target_modules"], args["max_lora_rank"], args["max_loras"],
                           config.generator.tensor_parallel_size, DTYPE_BYTES[config.model.dtype])


def _estimate_or_none(config: RLConfig, model_config: dict) -> list[Estimate] | None:
    try:
        return estimate(config, model_config)
    except (KeyError, TypeError, ZeroDivisionError):  # a config.json without the keys Shape reads
        return None


def _gpu(config: RLConfig, component: str) -> float | None:
    gib = config.cluster.gpu_memory_gib
    has_gpus = getattr(config.cluster, component).gpus_per_node > 0
    return gib * GIB if gib and has_gpus else None


def memory_lines(config: RLConfig, model_config: dict | None = None) -> list[str]:
    """The estimate as `describe` prints it; reads the model's config.json when not given."""
    if model_config is None:
        file = Path(config.model.path) / "config.json"
        try:
            model_config = json.loads(file.read_text())
        except FileNotFoundError:
            return [f"  memory: not estimated: no {file} here (model.path)"]
        except (OSError, ValueError) as err:
            return [f"  memory: not estimated: {file}: {err}"]
    estimates = _estimate_or_none(config, model_config)
    if estimates is None:
        return [f"  memory: not estimated: {config.model.path}/config.json is of an architecture the estimate does "
                f"not know ({model_config.get('model_type')})"]
    lines = ["  memory estimate (docs/memory.md):"]
    for e in estimates:
        lines += e.lines()
    gpus = config.cluster.generators.gpus_per_node or config.cluster.trainers.gpus_per_node
    if gpus and not config.cluster.gpu_memory_gib:
        lines.append("    (set cluster.gpu_memory_gib (e.g. 80 for an H100 80GB) for a fits / does not fit verdict)")
    return lines


def check_memory(config: RLConfig, model_config: dict) -> None:
    """Refuse a job whose estimate clearly exceeds its GPUs: better now than an out-of-memory error
    after hours in the queue."""
    over = [e for e in _estimate_or_none(config, model_config) or () if e.capacity and e.over > MARGIN]
    if over:
        what = "; ".join(f"{e.role} needs ~{e.need / GIB:.1f} GiB of "
                         f"{e.capacity / GIB:.1f}" for e in over)
        raise UserError(
            f"the job does not fit its GPUs (cluster.gpu_memory_gib {config.cluster.gpu_memory_gib}): {what}. "
            "Lower trainer.micro_batch_size or generator.max_new_tokens, turn on trainer.gradient_checkpointing, "
            "or add ranks (see `rltools submit CONFIG --dry-run`); if you know the estimate is wrong, "
            "--set cluster.gpu_memory_gib=null submits without the check (docs/memory.md)")
