"""The learning-rate schedule, AdamW's settings and lora.init_from on the real tiny model (FSDP2 on CPU):
a resume continues the schedule and Adam's moments exactly; a run's adapters start from a saved one."""

import socket

import pytest
import torch

from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
from rltools.paths import RunPaths
from rltools.train.fsdp2 import FSDP2Backend
from rltools.train.loop import init_adapters
from rltools.config.lr_schedule import rate_at
from rltools.train.model import export_adapter, load_policy
from rltools.train.trainer import Trainer
from rltools.weight_formats import write_adapter
from tests.spawn import spawn

from .test_trainer import LORA, synthetic_batch

STEPS = 4
ALGORITHM = AlgorithmConfig(learning_rate=1e-2, lr_schedule="cosine", lr_warmup_steps=1, min_lr_ratio=0.1,
                            mini_batches=2, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)


def make_backend(model_path, lora: LoraConfig = LORA, algorithm: AlgorithmConfig = ALGORITHM, shard: bool = False):
    model = load_policy(ModelConfig(path=str(model_path), dtype="float32"), lora, shard=shard)
    trainer = Trainer(model, algorithm, micro_batch_size=4, max_new_tokens=6, pad_id=0, device=torch.device("cpu"),
                      total_steps=STEPS)
    return FSDP2Backend(model, trainer, rank=0)


def adapter(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in export_adapter(model)}


def adam_state(backend) -> list[dict]:
    optimizer = backend.trainer.optimizer
    return [{k: v.clone() for k, v in optimizer.state[p].items()} for p in backend.trainer.params]


def test_a_resume_continues_the_learning_rate_schedule_and_adams_moments(tiny_model, tmp_path):
    torch.manual_seed(0)
    whole = make_backend(tiny_model)
    rates = [whole.trainer.step(synthetic_batch(seed=s))["lr"] for s in range(STEPS)]
    # each step's metric: the mean of its two updates' rates, warm-up first, then the cosine to 0.1 x 1e-2
    expected = [(rate_at(ALGORITHM, STEPS, 2 * s) + rate_at(ALGORITHM, STEPS, 2 * s + 1)) / 2 for s in range(STEPS)]
    assert rates == pytest.approx(expected, rel=1e-12) and rates[0] < rates[1] > rates[2] > rates[3]

    torch.manual_seed(0)
    first = make_backend(tiny_model)
    for s in range(2):
        first.trainer.step(synthetic_batch(seed=s))
    paths = RunPaths(tmp_path)
    first.save(paths, 2, keep=2)
    del first

    resumed = make_backend(tiny_model)  # a fresh process: base weights, new optimizer, the clock at 0
    assert resumed.load(paths, 2)["step"] == 2 and resumed.trainer.steps_done == 2
    after = [resumed.trainer.step(synthetic_batch(seed=s))["lr"] for s in range(2, STEPS)]
    assert after == rates[2:]  # the same floats: the schedule has no state beyond the step
    group = resumed.trainer.optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.8, 0.95), 0.05, 1e-6)
    assert group["lr"] == rate_at(ALGORITHM, STEPS, 2 * STEPS - 1)
    for ours, theirs in zip(adam_state(resumed), adam_state(whole), strict=True):
        assert ours.keys() == theirs.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in ours:  # the moments came back, or steps 3-4 would have left them elsewhere
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-9)
    for name, tensor in adapter(whole.model).items():
        torch.testing.assert_close(adapter(resumed.model)[name], tensor, rtol=0, atol=1e-7)


def test_the_defaults_train_as_torchs_adamw_at_a_constant_rate(tiny_model):
    """weight decay 0, betas (0.9, 0.999), eps 1e-8, the rate unchanged: what the trainer did before."""
    backend = make_backend(tiny_model, algorithm=AlgorithmConfig(learning_rate=1e-3))
    group = backend.trainer.optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.9, 0.999), 0.0, 1e-8)
    assert [backend.trainer.step(synthetic_batch(seed=s))["lr"] for s in range(2)] == [1e-3, 1e-3]


def _saved_adapter(tiny_model, directory, lora: LoraConfig = LORA) -> dict[str, torch.Tensor]:
    """A trained-looking adapter (B no longer 0) written as a run's lora export writes it."""
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_()
    tensors = adapter(model)
    write_adapter(directory, tensors, lora, str(tiny_model))
    return tensors


def test_lora_init_from_starts_the_adapters_from_the_saved_ones(tiny_model, tmp_path):
    saved = _saved_adapter(tiny_model, tmp_path / "adapter")
    lora = LORA.model_copy(update={"init_from": str(tmp_path / "adapter")})
    backend = make_backend(tiny_model, lora=lora)
    init_adapters(lora, backend)
    loaded = adapter(backend.model)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    assert backend.trainer.step(synthetic_batch(seed=0))["grad_norm"] > 0  # and trains from there


def test_an_adapter_of_fewer_modules_leaves_the_others_as_peft_made_them(tiny_model, tmp_path):
    fewer = LoraConfig(rank=4, alpha=8, target_modules=["q_proj"])
    saved = _saved_adapter(tiny_model, tmp_path / "adapter", fewer)
    lora = LORA.model_copy(update={"init_from": str(tmp_path / "adapter")})
    torch.manual_seed(0)
    backend = make_backend(tiny_model, lora=lora)
    fresh = adapter(backend.model)
    init_adapters(lora, backend)
    for name, tensor in adapter(backend.model).items():
        assert torch.equal(tensor, saved[name] if name in saved else fresh[name]), name
    assert any(".v_proj.lora_B" in name and not tensor.any() for name, tensor in adapter(backend.model).items())


def _load_sharded(rank: int, world: int, model_path: str, port: int, adapter_dir: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lora = LORA.model_copy(update={"init_from": adapter_dir})
    backend = make_backend(model_path, lora=lora, shard=True)
    init_adapters(lora, backend)  # each rank copies its rows
    tensors = adapter(backend.model)  # collective
    if rank == 0:
        torch.save(tensors, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_fsdp_ranks_start_from_the_saved_adapter(tiny_model, tmp_path):
    saved = _saved_adapter(tiny_model, tmp_path / "adapter")
    spawn(_load_sharded, args=(2, str(tiny_model), _free_port(), str(tmp_path / "adapter"), str(tmp_path / "out.pt")), nprocs=2)
    loaded = torch.load(tmp_path / "out.pt")
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def _megatron_worker(rank: int, world: int, port: int, model_path: str, run_dir: str, adapter_dir: str) -> None:
    """One Megatron rank (TP=1 on CPU): the schedule through a checkpoint of the Megatron backend, and
    lora.init_from through its load_adapter."""
    import torch.distributed as dist

    from rltools.train.megatron.backend import MegatronBackend
    from rltools.train.megatron.model import load_megatron_policy
    from rltools.train.megatron.parallel import init_parallel
    from rltools.train.megatron.trainer import MegatronTrainer
    from tests.megatron_cpu import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lora = LORA.model_copy(update={"init_from": adapter_dir})

    def backend():
        policy = load_megatron_policy(ModelConfig(path=model_path, dtype="float32"), lora)
        trainer = MegatronTrainer(policy, ALGORITHM, micro_batch_size=4, max_new_tokens=6, pad_id=0,
                                  device=torch.device("cpu"), total_steps=STEPS)
        return MegatronBackend(policy, trainer, rank)

    result = {}
    with megatron_on_cpu():
        init_parallel(1, 1, seed=0)
        whole = backend()
        init_adapters(lora, whole)
        result["initial"] = {name: t.clone() for name, t in whole.export_adapter()}
        result["rates"] = [whole.trainer.step(synthetic_batch(seed=s))["lr"] for s in range(STEPS)]
        resumed = backend()
        init_adapters(lora, resumed)
        for s in range(2):
            resumed.trainer.step(synthetic_batch(seed=s))
        resumed.save(RunPaths(run_dir), 2, keep=2)
        resumed = backend()
        resumed.load(RunPaths(run_dir), 2)
        result["resumed_rates"] = [resumed.trainer.step(synthetic_batch(seed=s))["lr"] for s in range(2, STEPS)]
        result["group"] = {k: v for k, v in resumed.trainer.optimizer.param_groups[0].items() if k != "params"}
        for name, b in (("whole", whole), ("resumed", resumed)):
            result[name] = {n: t.clone() for n, t in b.export_adapter()}
    torch.save(result, f"{run_dir}/megatron.pt")
    dist.destroy_process_group()


def test_the_megatron_backend_continues_the_schedule_and_starts_from_the_adapter(tiny_model, tmp_path):
    saved = _saved_adapter(tiny_model, tmp_path / "adapter")
    spawn(_megatron_worker, args=(1, _free_port(), str(tiny_model), str(tmp_path), str(tmp_path / "adapter")), nprocs=1)
    result = torch.load(tmp_path / "megatron.pt", weights_only=False)
    assert result["initial"].keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(result["initial"][name], tensor), name
    assert result["resumed_rates"] == result["rates"][2:]
    assert (result["group"]["betas"], result["group"]["weight_decay"], result["group"]["eps"]) == ((0.8, 0.95), 0.05, 1e-6)
    for name, tensor in result["whole"].items():  # Adam's moments came back through the Megatron checkpoint view
        torch.testing.assert_close(result["resumed"][name], tensor, rtol=0, atol=1e-7)
