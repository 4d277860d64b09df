"""Checkpoints on the real tiny model: exact resume, resharding across trainer ranks, crash safety."""

import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
from rltools.paths import RunPaths
from rltools.train import checkpoints
from rltools.train.model import export_adapter, load_policy
from rltools.train.trainer import Trainer
from tests.spawn import spawn

from .adam_bound import adapter_atol, condition
from .test_trainer import LORA, synthetic_batch


def make_trainer(tiny_model, rank=0, world=1):
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    if world > 1:
        from rltools.train.model import shard_model

        shard_model(model)  # before the optimizer takes the parameters, as the trainer loop does
    trainer = Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=4, max_new_tokens=6,
                      pad_id=0, device=torch.device("cpu"), rank=rank, world_size=world)
    return model, condition(trainer)  # AdamW's eps as adam_bound.py sets it, for runs that sum in other orders


def adapter(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in export_adapter(model)}


def test_resume_from_a_checkpoint_equals_uninterrupted_training(tiny_model, tmp_path):
    paths = RunPaths(tmp_path)
    torch.manual_seed(0)
    model, trainer = make_trainer(tiny_model)
    for s in range(4):
        trainer.step(synthetic_batch(seed=s))
    uninterrupted = adapter(model)

    torch.manual_seed(0)
    model, trainer = make_trainer(tiny_model)
    for s in range(2):
        trainer.step(synthetic_batch(seed=s))
    checkpoints.save(paths, 2, model, trainer.optimizer, rank=0, keep=2)
    del model, trainer

    model, trainer = make_trainer(tiny_model)  # a fresh process: base weights, new optimizer
    assert checkpoints.load(paths, paths.latest_checkpoint(), model, trainer.optimizer, rank=0)["step"] == 2
    for s in range(2, 4):
        trainer.step(synthetic_batch(seed=s))
    resumed = adapter(model)
    assert uninterrupted.keys() == resumed.keys()
    for name in uninterrupted:  # Adam's moments came back too, or steps 3-4 would differ
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=1e-7)
    saved = checkpoints.read_weights(paths.checkpoint_dir(2))
    assert saved and all("lora_" in name for name in saved), sorted(saved)[:5]  # adapters only, no frozen base


def _save_sharded(rank: int, world: int, model_path: str, port: int, run_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, trainer = make_trainer(model_path, rank, world)
    trainer.step(synthetic_batch(seed=0))
    checkpoints.save(RunPaths(run_dir), 1, model, trainer.optimizer, rank=rank, keep=2)
    trainer.step(synthetic_batch(seed=1))
    weights = adapter(model)  # collective
    if rank == 0:
        torch.save(weights, f"{run_dir}/after_two_steps.pt")
    dist.destroy_process_group()


def test_a_checkpoint_of_two_fsdp_ranks_resumes_on_one(tiny_model, tmp_path):

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_save_sharded, args=(2, str(tiny_model), port, str(tmp_path)), nprocs=2)
    paths = RunPaths(tmp_path)
    assert list(paths.valid_checkpoints()) == [1]
    model, trainer = make_trainer(tiny_model)
    checkpoints.load(paths, 1, model, trainer.optimizer, rank=0)
    grad_norm = trainer.step(synthetic_batch(seed=1))["grad_norm"]
    expected = torch.load(tmp_path / "after_two_steps.pt")
    # step 2 sums its gradients in another order than the two ranks' (one rank, no reduce-scatter):
    # within adam_bound.py's bound for one step; Adam's moments lost would move the adapters ~lr
    atol = adapter_atol(trainer.algorithm.learning_rate, [grad_norm])
    for name, tensor in adapter(model).items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=atol)


def test_only_checkpoints_with_their_marker_count_and_debris_is_cleaned(tiny_model, tmp_path):
    paths = RunPaths(tmp_path)
    model, trainer = make_trainer(tiny_model)
    checkpoints.save(paths, 3, model, trainer.optimizer, rank=0, keep=2)
    paths.checkpoint_dir(5).mkdir()  # published but marker-less: never valid
    (paths.checkpoint_dir(5) / "meta.json").write_text("{}")
    paths.checkpoint_tmp(6).mkdir()  # a save that died before its rename
    assert paths.latest_checkpoint() == 3
    removed = checkpoints.clean_incomplete(paths)
    assert sorted(p.name for p in removed) == [".step_6.tmp", "step_5"]
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["step_3"]


def test_keeps_the_last_k_checkpoints(tiny_model, tmp_path):
    paths = RunPaths(tmp_path)
    model, trainer = make_trainer(tiny_model)
    for step in (1, 2, 3, 4):
        checkpoints.save(paths, step, model, trainer.optimizer, rank=0, keep=2)
    assert list(paths.valid_checkpoints()) == [3, 4]


BIG_SAVE = """
import sys, torch
from rltools.train import checkpoints
from rltools.paths import RunPaths
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])  # ~67M params: a slow save
optimizer = torch.optim.AdamW(model.parameters())
paths = RunPaths(sys.argv[1])
checkpoints.save(paths, 1, model, optimizer, rank=0, keep=5)
print("saved 1", flush=True)
checkpoints.save(paths, 2, model, optimizer, rank=0, keep=5)
print("saved 2", flush=True)
"""


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    paths = RunPaths(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", BIG_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saved 1"
    deadline = time.monotonic() + 60
    while not paths.checkpoint_tmp(2).exists():
        assert time.monotonic() < deadline and child.poll() is None, "the second save never started"
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert paths.latest_checkpoint() == 1, "a checkpoint killed mid-save must not count"
    assert checkpoints.clean_incomplete(paths) == [paths.checkpoint_tmp(2)]
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    assert checkpoints.load(paths, 1, model, torch.optim.AdamW(model.parameters()), rank=0)["step"] == 1


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":  # 64 bytes in the middle of the tensor data
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 3]))
    else:
        path.unlink()


@pytest.mark.parametrize("how,problem", [("flip", "fails its checksum"), ("truncate", r"has \d+ bytes, \d+ were written"),
                                         ("delete", "is missing")])
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumes(tiny_model, tmp_path, how, problem):
    """Flipped bytes loaded silently before (reward 0 for every later step), and a truncated file made
    every resume fail with a DCP error naming no file."""
    paths = RunPaths(tmp_path)
    model, trainer = make_trainer(tiny_model)
    for step in (1, 2):
        trainer.step(synthetic_batch(seed=step))
        checkpoints.save(paths, step, model, trainer.optimizer, rank=0, keep=2)
    saved = adapter(model)
    _damage(next(paths.checkpoint_dir(2).glob("*.distcp")), how)
    assert checkpoints.verify(paths.checkpoint_dir(1)) == []

    start, notes = checkpoints.resume_point(paths)
    assert start == 1 and paths.latest_checkpoint() == 1
    assert len(notes) == 1 and re.search(rf"checkpoint {paths.checkpoint_dir(2)} is damaged \(__0_0.distcp {problem}", notes[0])
    rejected = list(paths.rejected_checkpoints.iterdir())
    assert [p.name.split(".")[0] for p in rejected] == ["step_2"] and str(rejected[0]) in notes[0]  # kept aside
    model, trainer = make_trainer(tiny_model)
    checkpoints.load(paths, 1, model, trainer.optimizer, rank=0)
    assert any(not torch.equal(t, saved[n]) for n, t in adapter(model).items())  # step 1's adapters, not step 2's
    checkpoints.save(paths, 2, model, trainer.optimizer, rank=0, keep=1)
    assert list(paths.valid_checkpoints()) == [2] and checkpoints.verify(paths.checkpoint_dir(2)) == []


def test_a_checkpoint_that_fails_to_load_names_itself(tiny_model, tmp_path):
    """A checkpoint from before checksums (nothing to verify) that DCP cannot read: the error names
    the directory and what to do, instead of a bare stream error."""
    paths = RunPaths(tmp_path)
    model, trainer = make_trainer(tiny_model)
    checkpoints.save(paths, 1, model, trainer.optimizer, rank=0, keep=2)
    (paths.checkpoint_dir(1) / checkpoints.MANIFEST).unlink()
    _damage(next(paths.checkpoint_dir(1).glob("*.distcp")), "truncate")
    assert checkpoints.resume_point(paths) == (1, [])  # unverifiable: tried
    with pytest.raises(RuntimeError, match=rf"loading checkpoint {paths.checkpoint_dir(1)} failed .*move it into "):
        checkpoints.load(paths, 1, model, trainer.optimizer, rank=0)


def test_a_full_disk_fails_the_save_naming_it_and_keeps_the_previous_checkpoint(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): no filesystem to fill")
    try:
        paths = RunPaths(disk)
        model, trainer = make_trainer(tiny_model)
        checkpoints.save(paths, 1, model, trainer.optimizer, rank=0, keep=2)
        subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k"], capture_output=True)
        with pytest.raises(OSError, match=rf"No space left on device \(writing checkpoint {paths.checkpoint_tmp(2)}\)"):
            checkpoints.save(paths, 2, model, trainer.optimizer, rank=0, keep=2)
        assert not paths.checkpoint_tmp(2).exists(), "the half-written checkpoint gives its space back"
        assert list(paths.valid_checkpoints()) == [1] and checkpoints.verify(paths.checkpoint_dir(1)) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)])
