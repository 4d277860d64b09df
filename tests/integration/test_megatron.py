"""The Megatron backend on the real tiny model, TP=2 on two CPU processes (gloo), against HF/peft and
the FSDP2 backend. megatron-core runs here through the test-only shim `tests/megatron_cpu.py`.

One TP=2 run (module fixture) records logits, exports, GRPO steps and a checkpoint; the tests then
compare pieces of it. Tolerances are fp32 ones: the computations are the same up to summation order.
"""

import shutil
import socket

import pytest
import torch

from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
from rltools.paths import RunPaths
from rltools.train.model import export_adapter, load_policy

from .test_trainer import LORA, _train_one_step, synthetic_batch

STEPS = 3  # GRPO steps compared with FSDP2; the checkpoint is written after step 1


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def _worker(rank: int, world: int, port: int, model_path: str, run_dir: str, mode: str, tp: int) -> None:
    import torch.distributed as dist

    from rltools.train.megatron import checkpoint as mckpt
    from rltools.train.megatron.model import export_adapter as m_adapter
    from rltools.train.megatron.model import export_weights as m_weights
    from rltools.train.megatron.model import init_parallel, load_adapter, load_megatron_policy
    from rltools.train.megatron.trainer import MegatronTrainer
    from tests.megatron_cpu import megatron_on_cpu

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with megatron_on_cpu():
        init_parallel(tp, seed=0)
        policy = load_megatron_policy(ModelConfig(path=model_path, dtype="float32"), LORA)
        if mode != "logits":
            load_adapter(policy, torch.load(f"{run_dir}/initial_adapter.pt"))
        dp_rank, dp_size = rank // tp, world // tp  # megatron orders TP ranks innermost
        trainer = MegatronTrainer(policy, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=2,
                                  max_new_tokens=6, pad_id=0, device=torch.device("cpu"), rank=dp_rank,
                                  world_size=dp_size)
        result = {}
        if mode == "logits":  # another architecture: forward and export only
            with torch.no_grad():
                result["logits"] = policy(*_ids())
            result["base_weights"] = dict(m_weights(policy))
        elif mode == "train":
            with torch.no_grad():
                result["logits"] = policy(*_ids())
            result["base_weights"] = dict(m_weights(policy))
            result["metrics"] = []
            for step in range(STEPS):
                result["metrics"].append(trainer.step(synthetic_batch(seed=step)))
                if step == 1:
                    result["weights_after_2"] = dict(m_weights(policy))
                if step == 0:
                    mckpt.save(RunPaths(run_dir), 1, policy, trainer.optimizer, rank=rank, keep=2)
        else:  # resume the TP=2 checkpoint at this TP degree
            result["meta"] = mckpt.load(RunPaths(run_dir), 1, policy, trainer.optimizer, rank=rank)
            for step in range(1, STEPS):
                result["metrics"] = trainer.step(synthetic_batch(seed=step))
        result["weights"] = dict(m_weights(policy))
        result["adapter"] = dict(m_adapter(policy))
        with torch.no_grad():
            result["trained_logits"] = policy(*_ids())
    if rank == 0:
        torch.save(result, f"{run_dir}/{mode}_{world}_tp{tp}.pt")
    dist.destroy_process_group()


def _spawn(world: int, model_path, run_dir, mode: str, tp: int | None = None) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tp = tp or world
    mp.spawn(_worker, args=(world, port, str(model_path), str(run_dir), mode, tp), nprocs=world)
    return torch.load(f"{run_dir}/{mode}_{world}_tp{tp}.pt", weights_only=False)


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory):
    """A TP=2 run that starts from the adapters peft initialises under seed 0 (as the FSDP2 run)."""
    run_dir = tmp_path_factory.mktemp("megatron")
    torch.manual_seed(0)
    peft_model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    torch.save(dict(export_adapter(peft_model)), run_dir / "initial_adapter.pt")
    return run_dir, _spawn(2, tiny_model, run_dir, "train")


def test_conversion_round_trip_is_exact(tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rltools.train.megatron import convert

    hf = load_file(str(tiny_model / "model.safetensors"))
    shape = convert.Shape.from_hf(AutoConfig.from_pretrained(tiny_model))
    back = {}
    for name, hf_names in convert.name_map(shape).items():
        full = convert.to_megatron(name, [hf[n] for n in hf_names], shape)
        shards = [convert.shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(convert.unshard(name, shards), full)
        back.update(zip(hf_names, convert.to_hf(name, full, shape)))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_tp2_logits_equal_the_hf_model(tp2, tiny_model):
    _, run = tp2
    hf = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LoraConfig(enabled=False))
    ids, mask = _ids()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    real = mask.bool()
    diff = (run["logits"] - expected)[real].abs().max().item()
    print(f"max |TP=2 - HF| logit: {diff:.2e}")
    assert diff < 1e-4, f"max |TP=2 - HF| logit {diff:.2e}"
    base = dict(hf.state_dict())
    assert run["base_weights"].keys() == base.keys()
    assert all(torch.equal(run["base_weights"][n], base[n]) for n in base)  # gathered export is exact


def test_grouped_query_attention_and_tied_embeddings_at_tp2(tmp_path):
    """The tiny model has as many KV heads as heads and an untied head: check the q/k/v grouping
    (2 query heads per KV head) and a tied output layer on a random Llama with both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                         tie_word_embeddings=True, rms_norm_eps=1e-6)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "gqa")
    run = _spawn(2, tmp_path / "gqa", tmp_path, "logits")
    ids, mask = _ids()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    diff = (run["logits"] - expected)[mask.bool()].abs().max().item()
    assert diff < 1e-4, f"max |TP=2 - HF| logit {diff:.2e}"
    base = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight"}  # tied: vLLM needs no lm_head
    assert run["base_weights"].keys() == base.keys()
    assert all(torch.equal(run["base_weights"][n], base[n]) for n in base)


@pytest.fixture(scope="module")
def fsdp2(tiny_model, tmp_path_factory):
    """Two GRPO steps of the FSDP2 backend (one rank; it equals two ranks: test_trainer.py)."""
    out = tmp_path_factory.mktemp("fsdp2") / "fsdp.pt"
    _train_one_step(0, 1, str(tiny_model), 0, str(out))  # seed 0 adapters, as the Megatron runs start
    return torch.load(out)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_grpo_steps_match_fsdp2_on_the_same_data(layout, tp2, fsdp2, tiny_model, tmp_path):
    """Same adapters at start, same rollouts: loss, grad norm and weights follow the FSDP2 backend,
    at TP=2 and at TP=1 x DP=2 (each DP rank trains on half the samples)."""
    fsdp = fsdp2
    if layout == "tp2":
        _, run = tp2
    else:
        shutil.copy(tp2[0] / "initial_adapter.pt", tmp_path)
        run = _spawn(2, tiny_model, tmp_path, "train", tp=1)
    for ours, theirs in zip(run["metrics"], fsdp["metrics"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert ours["reward_mean"] == theirs["reward_mean"]
    assert run["metrics"][0]["grad_norm"] > 0
    # merged weights after both steps; Adam's 1/sqrt(v) magnifies summation-order noise on weights
    # with tiny gradients (seen: up to 3.4e-6, against updates of ~1e-2)
    for name, tensor in fsdp["weights"].items():
        torch.testing.assert_close(run["weights_after_2"][name], tensor, rtol=1e-4, atol=1e-5)


def test_tp2_checkpoint_resumes_at_tp1(tp2, tiny_model):
    run_dir, run = tp2
    resumed = _spawn(1, tiny_model, run_dir, "resume")
    assert resumed["meta"]["step"] == 1
    # Without Adam's moments steps 2-3 would differ by ~lr (1e-2) per weight; TP=1 sums in another
    # order than TP=2, which Adam's 1/sqrt(v) magnifies for weights with tiny gradients (seen: up to 1.4e-5; 5e-5 = 0.5% of lr).
    for name, tensor in run["adapter"].items():
        torch.testing.assert_close(resumed["adapter"][name], tensor, rtol=1e-4, atol=5e-5)


def test_adapter_export_loads_in_peft(tp2, tiny_model, tmp_path):
    from peft import PeftModel

    from rltools.eval.checkpoints import save_policy

    _, run = tp2
    assert any(t.abs().sum() > 0 for n, t in run["adapter"].items() if "lora_B" in n)  # trained: B moved off 0
    save_policy(tmp_path / "adapter", list(run["adapter"].items()), "lora", str(tiny_model), LORA, step=STEPS)
    base = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LoraConfig(enabled=False))
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids, mask = _ids()
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    diff = (run["trained_logits"] - logits)[mask.bool()].abs().max().item()
    assert diff < 1e-4, f"max |Megatron - peft(exported adapter)| logit {diff:.2e}"
    merged = peft_model.merge_and_unload().state_dict()
    for name, tensor in merged.items():  # the merged full-weight export agrees with peft's merge
        torch.testing.assert_close(run["weights"][name], tensor, rtol=1e-5, atol=1e-6)
