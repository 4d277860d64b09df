"""Methods vLLM mixes into each of its workers (`worker_extension_cls`), called via `collective_rpc`.

Why inside the workers: with tensor parallelism each worker holds its own shard of the model, so
each joins the weight-sync group itself and loads what it receives; the generator process only
orchestrates. With the in-process CPU engine the "worker" is in the generator's own process.
"""

from pathlib import Path

import torch

from ..paths import RunPaths


class WeightSyncExtension:
    def rltools_join_sync(
        self, run_dir: str, first_rank: int, world_size: int, attempt: str, backend: str, timeout_s: float, fmt
    ) -> int:
        """Join the weight-sync group as sync rank first_rank + this worker's TP rank, to receive weights
        of format `fmt` (rltools.weight_formats); returns that rank."""
        from ..weight_sync import SyncOptions, WeightReceiver, join_group

        rank = first_rank + self.rank
        options = SyncOptions(backend=backend, join_timeout_s=timeout_s, collective_timeout_s=timeout_s)
        device = self.device if backend == "nccl" else None
        group = join_group(RunPaths(run_dir), rank=rank, world_size=world_size, attempt=attempt, options=options, device=device)
        self._rltools_receiver = WeightReceiver(group)
        self._rltools_format = fmt
        return rank

    def rltools_receive_weights(self, timeout_s: float, adapter_dir: str) -> tuple[int, str]:
        """Receive one weight message from trainer rank 0 and apply it as its format says (full: loaded
        in place; lora: written as a PEFT adapter under `adapter_dir`, which the engine then serves);
        returns (policy version, kind)."""
        received: list[tuple[str, torch.Tensor]] = []
        # The channel's views are valid only inside the callback: copy them out.
        transfer = self._rltools_receiver.receive(
            lambda pairs: received.extend((name, tensor.clone()) for name, tensor in pairs), timeout_s=timeout_s
        )
        fmt = self._rltools_format
        if transfer.kind != fmt.name:
            raise RuntimeError(f"trainer rank 0 sent {transfer.kind} weights; this generator serves {fmt.name} "
                               "(generator.weight_sync differs between the roles' configs)")
        fmt.apply(self, received, Path(adapter_dir))
        return transfer.version, transfer.kind
