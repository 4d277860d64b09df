"""The trainer's pieces on the real tiny model: weight export, logprob agreement with vLLM, FSDP2."""

import numpy as np
import pytest
import torch

from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
from rltools.rollout import FinishReason, RolloutBatch, Sample
from rltools.train.logprobs import completion_logprobs, pack
from rltools.train.model import export_adapter, export_weights, load_policy
from rltools.train.trainer import Trainer
from tests.spawn import spawn

from .adam_bound import assert_runs_agree, condition

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.mark.parametrize("lora", [LORA, LoraConfig(rank=4, alpha=8, target_modules=["o_proj", "lm_head"])],
                         ids=["layers", "head"])
def test_export_merges_lora_like_peft(tiny_model, lora):
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # B starts at zero: make the adapters matter
    # copies: on one rank an unmerged weight is exported as a view of the parameter merge_and_unload changes
    exported = {name: tensor.clone() for name, tensor in export_weights(model, lora_scale=lora.alpha / lora.rank)}
    merged = model.merge_and_unload().state_dict()
    assert set(exported) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6)


def vllm_samples(tiny_model, prompts, n=4, model_cfg: ModelConfig | None = None, generator_cfg=None):
    from rltools.config.schema import GeneratorConfig
    from rltools.generate.vllm_engine import VLLMEngine
    from rltools.weight_formats import FullWeights

    engine = VLLMEngine(
        model_cfg or ModelConfig(path=str(tiny_model), dtype="float32"),
        generator_cfg or GeneratorConfig(max_new_tokens=6, kv_cache_memory_bytes=64 * 2**20),
        seed=0,
        fmt=FullWeights(str(tiny_model), LoraConfig(rank=4, alpha=8)),
    )
    groups = engine.sample(prompts, n=n, seeds=list(range(len(prompts))))
    samples = [e.sample(0.0, g, j) for g, group in enumerate(groups) for j, e in enumerate(group)]
    return RolloutBatch.from_samples(samples, policy_version=0)


def logprob_gap(model, batch: RolloutBatch, device=torch.device("cpu")) -> float:
    """Mean |trainer - generator| logprob over the batch's completion tokens (at least 10 of them)."""
    model.eval()
    with torch.no_grad():
        packed = pack(batch, np.arange(len(batch)), pad_id=0, device=device)
        ours, _ = completion_logprobs(model, packed)
    assert packed.mask.sum() > 10
    return float(((ours - packed.old_logprobs).abs() * packed.mask).sum() / packed.mask.sum())


def test_trainer_logprobs_match_vllm(tiny_model):
    """The usual silent RL bug: trainer and generator disagreeing on what the policy's logprobs are."""
    batch = vllm_samples(tiny_model, ["What is 12+7?=", "What is 3*4+5?=", "What is 90-45?="])
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LoraConfig(enabled=False))
    diff = logprob_gap(model, batch)
    assert diff < 1e-3, f"mean |trainer - vLLM| logprob = {diff:.2e}"


def test_grpo_step_moves_the_policy_toward_rewarded_samples(tiny_model):
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    batch = vllm_samples(tiny_model, ["What is 12+7?="], n=8)
    rewards = np.array([1.0 if i % 2 == 0 else 0.0 for i in range(len(batch))], dtype=np.float32)
    batch = RolloutBatch(**{**batch.arrays, "rewards": rewards}, policy_version=0)
    # Large enough to move the margin in one step, small enough not to overshoot: Adam's first step
    # moves every LoRA weight by ~lr (5e-2 overshot on the current tiny model; 1e-2 and 5e-3 pass).
    trainer = Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=3, max_new_tokens=6,
                      pad_id=0, device=torch.device("cpu"))
    packed = pack(batch, np.arange(len(batch)), pad_id=0, device=torch.device("cpu"))

    def margin():
        with torch.no_grad():
            lp, _ = completion_logprobs(model, packed)
        per_seq = (lp * packed.mask).sum(1)
        return float(per_seq[rewards == 1].mean() - per_seq[rewards == 0].mean())

    before = margin()
    metrics = trainer.step(batch)
    assert margin() > before + 0.05
    assert metrics["reward_mean"] == 0.5 and metrics["logprob_diff"] < 1e-3
    assert metrics["grad_norm"] > 0


def synthetic_batch(n=8, seed=0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        completion = rng.integers(3, 20, rng.integers(1, 6)).tolist()
        samples.append(Sample(rng.integers(3, 20, rng.integers(4, 10)).tolist(), completion,
                              (-rng.random(len(completion))).tolist(), float(i % 3 == 0), i // 4, i % 4,
                              FinishReason.STOP))
    return RolloutBatch.from_samples(samples, policy_version=0)


def _train_one_step(rank: int, world: int, model_path: str, port: int, out: str, quantization: str = "none",
                    gradient_checkpointing: bool = False, lora: LoraConfig = LORA) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    # As the FSDP2 backend builds it: on the meta device, sharded there, each rank reading its rows.
    model = load_policy(ModelConfig(path=model_path, dtype="float32", quantization=quantization), lora,
                        gradient_checkpointing, shard=world > 1)
    trainer = condition(Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=2, max_new_tokens=6,
                                pad_id=0, device=torch.device("cpu"), rank=rank, world_size=world))
    metrics = [trainer.step(synthetic_batch(seed=s)) for s in range(2)]
    weights = dict(export_weights(model, lora.alpha / lora.rank))
    adapter = dict(export_adapter(model))  # collective under FSDP2, like export_weights
    if rank == 0:
        local = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in model.named_parameters()}
        torch.save({"weights": weights, "adapter": adapter, "metrics": metrics, "local_numel": local,
                    "lr": trainer.algorithm.learning_rate}, out)
    if world > 1:
        dist.destroy_process_group()


def train_one_and_two_ranks(model_path, tmp_path, lora: LoraConfig = LORA, quantization: str = "none") -> tuple[dict, dict]:
    """One step of the same batches on one trainer rank and on two FSDP2 ranks."""
    import socket

    _train_one_step(0, 1, str(model_path), 0, str(tmp_path / "single.pt"), quantization, lora=lora)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_train_one_step, args=(2, str(model_path), port, str(tmp_path / "fsdp.pt"), quantization, False, lora), nprocs=2)
    return torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "fsdp.pt")


def test_fsdp2_two_ranks_match_one_rank(tiny_model, tmp_path):
    single, sharded = train_one_and_two_ranks(tiny_model, tmp_path)
    for a, b in zip(single["metrics"], sharded["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # the reduce-scatter sums the gradients in another order: adam_bound.py derives how far that moves them
    assert_runs_agree(sharded, single, lr=single["lr"], grad_norms=[m["grad_norm"] for m in single["metrics"]],
                      lora_scale=LORA.alpha / LORA.rank, lora_rank=LORA.rank)
    base = dict(load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LoraConfig(enabled=False)).state_dict())
    assert any(not torch.equal(base[n], t) for n, t in single["weights"].items())  # training did something


def test_shared_prompt_logprobs_equal_a_full_sequence_forward(tiny_model):
    """Running each distinct prompt once (KV cache gathered to its samples) changes no logprob or gradient."""
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    batch = synthetic_batch(n=12, seed=3)  # then give each group of 4 one prompt
    groups = [batch.prompt(4 * (i // 4)).tolist() for i in range(len(batch))]
    samples = [Sample(groups[i], batch.completion(i).tolist(), batch.logprobs(i).tolist(), 0.0, i // 4, i % 4,
                      FinishReason.STOP) for i in range(len(batch))]
    batch = RolloutBatch.from_samples(samples, policy_version=0)
    packed = pack(batch, np.arange(len(batch)), pad_id=0, device=torch.device("cpu"))
    assert packed.prompt_ids.shape[0] == 3
    ours, _ = completion_logprobs(model, packed)
    (ours * packed.mask).sum().backward()  # padding positions hold junk by design
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    reference = []
    for i in range(len(batch)):  # plain: the whole sequence, one sample at a time
        prompt, completion = batch.prompt(i).tolist(), batch.completion(i).tolist()
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        reference.append(logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt):, None]).squeeze(-1))
    torch.stack([r.sum() for r in reference]).sum().backward()
    # Both paths are float32 and sum in other orders (attention over a padded, cached prompt). Each is
    # within 8e-5 (logprobs, up to 14 in size) and 6e-5 x a tensor's largest gradient of a float64 run;
    # here they share most of that error (they differ by 1.1e-5 and 7e-6 x), another host's kernels
    # need not. 1e-3 is 6x the sum of both errors; a mask or position off by one moves logprobs by ~1.
    for i, ref in enumerate(reference):
        torch.testing.assert_close(ours[i, : len(ref)], ref.detach(), rtol=0, atol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=0,
                                   atol=1e-3 * grad.abs().max().item())


# Gradient checkpointing (trainer.gradient_checkpointing) must change memory, not numbers. The
# recompute replays the same kernels on the same inputs, so on CPU the results are in fact bitwise
# equal; the tolerance allows only a reordered fp32 summation: a length-K dot product then moves by
# at most ~K x eps relative (K <= 344, the tiny model's widest reduction; eps = 1.2e-7: 4e-5), far
# below what a dropped or doubled gradient term would change.
CHECKPOINTING_RTOL = 4e-5


def _assert_same_training(plain: dict, checkpointed: dict) -> None:
    for a, b in zip(plain["metrics"], checkpointed["metrics"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=CHECKPOINTING_RTOL, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=CHECKPOINTING_RTOL)
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(checkpointed["weights"][name], tensor, rtol=CHECKPOINTING_RTOL, atol=1e-7)


@pytest.mark.parametrize("quantization", ["none", "nvfp4"])
def test_gradient_checkpointing_trains_exactly_as_without(tiny_model, tmp_path, quantization):
    for checkpointing in (False, True):
        _train_one_step(0, 1, str(tiny_model), 0, str(tmp_path / f"{checkpointing}.pt"), quantization, checkpointing)
    plain, checkpointed = torch.load(tmp_path / "False.pt"), torch.load(tmp_path / "True.pt")
    assert all(m["grad_norm"] > 0 for m in plain["metrics"])
    _assert_same_training(plain, checkpointed)


def test_gradient_checkpointing_with_fsdp2_on_an_nvfp4_base(tiny_model, tmp_path):
    """Two FSDP2 ranks recomputing their layers (weights gathered again in backward) train as one
    rank that keeps its activations."""
    import socket

    _train_one_step(0, 1, str(tiny_model), 0, str(tmp_path / "plain.pt"), "nvfp4")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_train_one_step, args=(2, str(tiny_model), port, str(tmp_path / "fsdp.pt"), "nvfp4", True), nprocs=2)
    plain, sharded = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "fsdp.pt")
    # FSDP2 itself reorders the gradient sums (reduce-scatter): its own test's bounds (adam_bound.py)
    for a, b in zip(plain["metrics"], sharded["metrics"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert_runs_agree(sharded, plain, lr=plain["lr"], grad_norms=[m["grad_norm"] for m in plain["metrics"]],
                      lora_scale=LORA.alpha / LORA.rank, lora_rank=LORA.rank)


def test_gradient_checkpointing_recomputes_each_layer_and_holds_less(tiny_model):
    """With checkpointing, every decoder layer runs again in backward (once per forward pass: the
    shared prompt's and the completions'), and far fewer activation bytes are held between forward
    and backward — counted from the storages still alive then, so the layer inputs and KV cache that
    checkpointing keeps are included."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Allocations(TorchDispatchMode):
        """Every storage an op creates, weakly: (ref, bytes) by storage id."""

        def __init__(self):
            super().__init__()
            self.storages = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
            return out

    packed = pack(synthetic_batch(seed=0), np.arange(8), pad_id=0, device=torch.device("cpu"))
    held, recomputed = {}, {}
    for checkpointing in (False, True):
        model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA, checkpointing)
        model.train()
        mlp_calls = []
        for layer in model.base_model.model.model.layers:
            # a pre-hook: torch's checkpoint stops the recompute once it has every saved tensor back,
            # before the MLP returns
            layer.mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
        with Allocations() as allocations:
            logprobs, _ = completion_logprobs(model, packed)
            loss = (logprobs * packed.mask).sum()
        weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        held[checkpointing] = sum(n for key, (ref, n) in allocations.storages.items()
                                  if key not in weights and not ref.expired())
        forward_calls = len(mlp_calls)
        loss.backward()
        recomputed[checkpointing] = len(mlp_calls) - forward_calls
    layers = model.config.num_hidden_layers
    assert recomputed == {False: 0, True: 2 * layers}
    # observed: 4.1 MB plain, 1.0 MB checkpointed; the gap grows with sequence length
    assert held[True] < 0.4 * held[False], held
