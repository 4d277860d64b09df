"""Starting test ranks: fork each from a server that imported the heavy modules once.

`torch.multiprocessing.spawn` starts fresh interpreters, and each pays the ~5 s of importing torch,
transformers, peft and megatron-core again; a test module that starts a dozen ranks pays it a dozen
times. A forkserver imports them once (PRELOAD) and forks clean processes from there: each rank
still starts with no process group, no CUDA and no megatron state of its own parent.
"""

import multiprocessing

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
           "peft", "megatron.core", "rltools.train.model", "rltools.train.trainer"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """As `torch.multiprocessing.spawn(fn, args, nprocs)`: fn(rank, *args) in nprocs processes."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
