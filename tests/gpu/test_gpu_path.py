"""What the GPU path does that no CPU test can show, on one GPU, without vLLM: the trainer's device
selection, the weight-sync deadline on real NCCL work, and NVFP4 dequantisation on CUDA.

Each test records its figures (`record_property`): scripts/gpu-check.sh puts them in its summary.
"""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_trainer_takes_its_gpu_in_both_slurm_layouts(monkeypatch):
    """Every task sees the node's GPUs (device local_rank), or Slurm binds one per task (device 0
    whatever the local rank): the device is made current, as FSDP2 needs."""
    from rltools.train.loop import trainer_device

    count = torch.cuda.device_count()
    assert trainer_device(count - 1) == torch.device("cuda", count - 1) and torch.cuda.current_device() == count - 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    if count == 1:  # one GPU visible, as under --gpus-per-task=1: every local rank takes device 0
        assert trainer_device(3) == torch.device("cuda", 0) and torch.cuda.current_device() == 0


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    group = dist.ProcessGroupNCCL(store, 0, 1)
    yield group
    group.shutdown()


def test_the_weight_sync_deadline_fires_on_nccl_work_that_wait_does_not_block_on(nccl_group, record_property):
    """NCCL's `Work.wait` returns before the collective ran (it orders streams); the channel's poll of
    `is_completed` against the deadline is what makes a stall end in our named error."""
    from rltools.weight_sync.channel import _Collectives, _Pending

    table = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU time queued before the collective, on the same stream
    begin = time.monotonic()
    work = nccl_group.allreduce([table])
    work.wait(timedelta(seconds=10))
    returned = time.monotonic() - begin
    pending = _Pending(work, "the test's all-reduce", begin, timedelta(seconds=0.2), table)
    with pytest.raises(RuntimeError, match="not completed by its deadline"):
        _Collectives._poll(pending)
    failed_after = time.monotonic() - begin
    torch.cuda.synchronize()
    completed = time.monotonic() - begin
    record_property("wait_returned_s", round(returned, 4))
    record_property("deadline_fired_s", round(failed_after, 4))
    record_property("work_completed_s", round(completed, 4))
    assert returned < 0.2 < failed_after < completed, (returned, failed_after, completed)
    assert work.is_completed()
    _Collectives._poll(_Pending(work, "done", time.monotonic(), timedelta(seconds=1), table))  # no error once done


def test_nvfp4_dequantisation_on_cuda_is_bitwise_the_cpus(record_property):
    """The generator on CPU serves the CPU-dequantised base; the trainer on GPU dequantises on CUDA:
    equal weights on both sides are what keeps the logprob gap at numerics."""
    from rltools.quant.nvfp4 import dequantize, quantize

    torch.manual_seed(0)
    weight = torch.randn(512, 1024) * 0.02
    q = quantize(weight)
    parts = (q.packed, q.scale, q.global_scale)
    cpu = dequantize(*parts)
    cuda = dequantize(*(t.cuda() for t in parts)).cpu()
    record_property("max_abs_difference", float((cpu - cuda).abs().max()))
    assert torch.equal(cpu, cuda)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(*parts, dtype=dtype), dequantize(*(t.cuda() for t in parts), dtype=dtype).cpu())
