"""The FSDP2 policy built on the meta device, rank by rank (`train.model.load_policy(shard=True)`):
the same model as one loaded whole, each rank reading and holding only its rows, and the streamed
export of one layer at a time. (Two GRPO steps on one rank against two: test_trainer, test_moe,
test_nvfp4; the memory of a 1.5 GB model: scripts/bench_sharded_build.py.)"""

import json
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltools.config.schema import LoraConfig, ModelConfig
from rltools.train.model import _with_lora, export_weights, load_policy
from rltools.weight_sync import TensorStream
from tests.spawn import spawn

from .conftest import TINY_MODEL

MOE = TINY_MODEL.parent / "tiny-moe-arith"
LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
TOKENS = torch.tensor([[3, 9, 14, 7, 22, 5, 11]])


@pytest.mark.parametrize("path", [TINY_MODEL, MOE], ids=["llama", "deepseek_v3"])
def test_the_meta_build_equals_peft_on_the_model_loaded_whole(path, tiny_model):
    """Base weights (routed experts fused as transformers holds them) and LoRA's initial matrices as
    peft makes them on a model transformers loads whole; the RNG left where peft leaves it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    whole = _with_lora(whole, LORA, nvfp4=False)
    after_whole = torch.rand(3)
    torch.manual_seed(0)
    built = load_policy(ModelConfig(path=str(path), dtype="float32"), LORA)
    assert torch.equal(torch.rand(3), after_whole)
    expected = whole.state_dict()
    assert set(built.state_dict()) == set(expected)
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert [n for n, p in built.named_parameters() if p.requires_grad] == [n for n, p in whole.named_parameters() if p.requires_grad]


def _build(rank: int, world: int, path: str, port: int, out: str) -> None:
    """Build on `world` ranks, counting the bytes each reads; logits, reads and the streamed export."""
    import torch.distributed as dist

    from rltools.quant.nvfp4_checkpoint import Source

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reads = []
    rows, get = Source.rows, Source.get
    Source.rows = lambda self, name, lo, hi: _record(reads, name, rows(self, name, lo, hi))
    Source.get = lambda self, name: _record(reads, name, get(self, name))
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=path, dtype="float32"), LORA, shard=world > 1)
    Source.rows, Source.get = rows, get
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    tied = model.get_base_model().lm_head.weight is model.get_base_model().model.embed_tokens.weight
    logits = model(input_ids=TOKENS).logits.detach()
    stream = export_weights(model, LORA.alpha / LORA.rank)
    exported = dict(stream)
    if rank == 0:
        torch.save({"reads": reads, "local": local, "tied": tied, "logits": logits, "exported": exported,
                    "specs": stream.specs, "is_stream": isinstance(stream, TensorStream)}, out)
    if world > 1:
        dist.destroy_process_group()


def _record(reads: list, name: str, tensor: torch.Tensor) -> torch.Tensor:
    reads.append((name, tensor.numel() * tensor.element_size()))
    return tensor


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """tiny-arith with its output embedding tied to the input one (no lm_head.weight stored)."""
    path = tmp_path_factory.mktemp("tied")
    for file in TINY_MODEL.iterdir():
        shutil.copy(file, path / file.name)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    state = load_file(str(path / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_two_ranks_each_read_and_hold_half_and_compute_the_model(tied_model, tmp_path):
    """Each rank reads about half of the checkpoint's bytes and holds half of the parameters; the
    tied embedding stays tied; logits and the streamed export equal one rank's."""
    _build(0, 1, str(tied_model), 0, str(tmp_path / "one.pt"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_build, args=(2, str(tied_model), port, str(tmp_path / "two.pt")), nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    stored = sum(t.numel() * t.element_size() for t in load_file(str(tied_model / "model.safetensors")).values())
    assert sum(n for _, n in one["reads"]) == stored
    assert 0.45 * stored < sum(n for _, n in two["reads"]) <= 0.55 * stored  # rank 0's rows of every tensor
    assert 0.45 * one["local"] < two["local"] <= 0.55 * one["local"]
    assert one["tied"] and two["tied"]
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    assert two["is_stream"] and two["specs"] == [(n, t.dtype, tuple(t.shape)) for n, t in two["exported"].items()]
    assert set(two["exported"]) == set(one["exported"]) == {n for n in load_file(str(tied_model / "model.safetensors"))}
    for name, tensor in one["exported"].items():
        torch.testing.assert_close(two["exported"][name], tensor)


def test_the_streamed_export_gathers_one_layer_at_a_time(tiny_model):
    """The stream's specs need nothing gathered; the tensors come one decoder layer at a time."""
    import rltools.train.model as model_module

    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    gathered = []
    whole = model_module._whole
    model_module._whole = lambda t: gathered.append(t.shape) or whole(t)
    try:
        stream = export_weights(model, LORA.alpha / LORA.rank)
        assert gathered == []
        first_layer = []
        for name, _ in stream:
            if ".layers.0." in name:
                first_layer.append(len(gathered))
            if ".layers.1." in name:
                break
    finally:
        model_module._whole = whole
    # layer 0's weights all came from one gathering, of the tensors before it and layer 0's alone
    layer0 = [n for n in model.state_dict() if ".layers.0." in n]
    assert len(set(first_layer)) == 1 and len(layer0) <= first_layer[0] < len(layer0) + 3
