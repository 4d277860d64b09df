"""What the GPU path does that no CPU test can show, on one GPU, without vLLM: the trainer's device
selection, torch's NCCL wait semantics and the weight-sync deadline and abandon hook on real NCCL
work, and NVFP4 dequantisation on CUDA.

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


GPU_SLEEP_CYCLES = int(3e9)  # torch.cuda._sleep: >= ~1.5 s of GPU time at <= 2 GHz, queued before a collective


@pytest.fixture
def sync_group():
    """A one-rank weight-sync group formed as rltools forms one (`nccl.nccl_group`, `nccl.connect`),
    its limit 1 s: torch's own NCCL timeout and error handling as the channel expects them."""
    import torch.distributed as dist

    from rltools.weight_sync.nccl import connect, nccl_group
    from rltools.weight_sync.rendezvous import SyncGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    device, limit = torch.device("cuda", 0), timedelta(seconds=1.0)
    pg = nccl_group(store, 0, 1, limit)
    connect(pg, device, 120, "the test's one-rank group")
    group = SyncGroup(pg, 0, 1, "nccl", device, limit, store)
    yield group
    torch.cuda.synchronize()
    group.close()  # aborted, as the channel gives a group up


def queued_behind_gpu_work(group) -> tuple[object, torch.Tensor, float]:
    """An all-reduce that starts only after ~1.5 s of GPU time on the same stream (a peer that is late)."""
    table = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    begin = time.monotonic()
    return group.pg.allreduce([table]), table, begin


def test_nccl_wait_orders_the_stream_without_a_timeout_and_blocks_the_thread_with_one(sync_group, record_property):
    """What the channel rests on (torch's `WorkNCCL::wait`): `wait()` returns while the collective is
    still queued; `wait(timeout)` blocks the CPU thread until it completed."""
    work, _, begin = queued_behind_gpu_work(sync_group)
    work.wait()
    returned = time.monotonic() - begin
    pending_after_wait = not work.is_completed()
    work.wait(timedelta(seconds=60))
    blocked = time.monotonic() - begin
    record_property("untimed_wait_returned_s", round(returned, 4))
    record_property("timed_wait_returned_s", round(blocked, 4))
    assert returned < 0.2 and pending_after_wait, returned
    assert blocked > 0.5 and work.is_completed(), blocked


def test_the_channel_gives_up_pending_nccl_work_at_its_deadline_or_when_abandoned(sync_group, record_property):
    """The channel's NCCL wait (order the stream, poll `is_completed()`) ends a collective that has
    not completed at our deadline, or sooner when `abandon` has a reason, while the GPU still works."""
    from rltools.weight_sync.channel import _Collectives, _Pending

    ops = _Collectives(sync_group, abandon=lambda: "generator 1's heartbeat stopped 61 s ago")
    work, table, begin = queued_behind_gpu_work(sync_group)
    with pytest.raises(RuntimeError, match="given up: generator 1's heartbeat stopped"):
        ops._wait_nccl(_Pending(work, "the test's all-reduce", begin, sync_group.timeout, table))
    given_up = time.monotonic() - begin
    still_pending = not work.is_completed()
    torch.cuda.synchronize()

    work, table, begin = queued_behind_gpu_work(sync_group)
    with pytest.raises(RuntimeError, match="not completed by its deadline"):
        _Collectives(sync_group)._wait_nccl(_Pending(work, "the test's all-reduce", begin, timedelta(seconds=0.2),
                                                     table))
    deadline_fired = time.monotonic() - begin
    torch.cuda.synchronize()
    completed = time.monotonic() - begin
    record_property("abandoned_after_s", round(given_up, 4))
    record_property("deadline_fired_s", round(deadline_fired, 4))
    record_property("work_completed_s", round(completed, 4))
    assert given_up < 0.5 and still_pending, given_up
    assert 0.2 < deadline_fired < 0.5 < completed, (deadline_fired, completed)
    assert work.is_completed()
    _Collectives(sync_group)._wait_nccl(_Pending(work, "done", time.monotonic(), timedelta(seconds=1), table))


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


def test_a_weight_sync_collective_abandoned_on_nccl_ends_in_a_named_error_and_the_process_lives_on(sync_group,
                                                                                                 record_property):
    """The whole path: the poll gives the collective up, the group is aborted (its pending collective
    with it); torch's watchdog, set to clean up only, must not take the process down afterwards.
    Last in the file: were NCCL's abort to crash the process, every other test here has run."""
    from rltools.weight_sync.channel import _Collectives
    from rltools.weight_sync.rendezvous import WeightSyncError

    ops = _Collectives(sync_group, abandon=lambda: "generator 1's heartbeat stopped 61 s ago")
    table = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    begin = time.monotonic()
    with pytest.raises(WeightSyncError, match="backend nccl.*given up: generator 1's heartbeat stopped"):
        ops.wait(ops.broadcast(table, "the test's broadcast"))
    failed_after = time.monotonic() - begin
    torch.cuda.synchronize()
    time.sleep(2.0)  # the watchdog's next rounds: with torch's default error handling it could abort us here
    record_property("named_error_after_s", round(failed_after, 4))
    assert failed_after < 60, failed_after  # torch's own abort is bounded by its timeout (limit + margin)
    with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
        ops.check_usable()
