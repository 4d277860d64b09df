"""The GRPO step on a Megatron policy: the FSDP2 Trainer's step with its backend parts replaced.

- Forward and backward: megatron-core's schedule (`get_forward_backward_func`: 1F1B over the
  pipeline stages, or micro batch after micro batch with one stage) runs the micro batches; the
  last stage turns logits into logprobs and the Trainer's own loss. Each micro batch is one
  full-sequence forward of [prompt; completion] per sample (Megatron's GPTModel has no Hugging
  Face KV-cache interface to share a prompt's forward pass between its samples); micro batches
  keep their own lengths (`variable_seq_lengths`: stages exchange activation shapes).
- Routing replay (`algorithm.routing_replay`): each micro batch's routers take the experts its
  rollouts recorded (`replay.py`), in the training pass and the KL reference pass alike.
- The KL reference (`algorithm.kl_coef > 0`) is one forward-only pass of the same schedule with
  the adapters off, before the training pass.
- Gradients: averaged over the data-parallel group first (each DP rank trains on its block of the
  step's samples, as FSDP2 ranks do); the clipping norm then sums the squares of TP-split adapters
  over the TP group, counts replicated ones once and adds the stages' sums, so it equals the
  unsharded model's norm.

The Trainer's rank and world size are the data-parallel ones: the TP and PP ranks of one model
replica run the same samples. Metrics come from the last stage and are averaged over the DP group.
"""

from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..logprobs import token_logprobs
from ..trainer import Trainer
from .parallel import from_last_stage, sum_over_pipeline


class MegatronTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.world_size > 1:
            from megatron.core import parallel_state

            self.group = parallel_state.get_data_parallel_group()  # metrics and gradients: DP ranks only

    def _forward_backward(self, batch, local: np.ndarray, advantages: torch.Tensor) -> dict[str, float]:
        blocks = [local[s : s + self.micro_batch_size] for s in range(0, len(local), self.micro_batch_size)]
        packs = [self._pack(batch, indices) for indices in blocks]
        refs = [None] * len(packs)
        if self.algorithm.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                refs = self._schedule(packs, lambda i, logits: self._completion_logprobs(packs[i], logits)[0],
                                      forward_only=True)

        def loss(i: int, logits: torch.Tensor):
            logprobs, entropy = self._completion_logprobs(packs[i], logits, with_entropy=True)
            value, metrics = self._loss(packs[i], logprobs, entropy, refs[i], advantages[blocks[i]].to(self.device))
            weight = len(blocks[i]) / len(local)
            # the schedule divides by the number of micro batches: this leaves `weight` x value
            return value * weight * len(packs), {k: v * weight for k, v in metrics.items()}

        outputs = self._schedule(packs, loss, forward_only=False)  # empty before the last stage
        return from_last_stage({k: sum(m[k] for m in outputs) for k in outputs[0]} if outputs else None)

    def _schedule(self, packs: list, on_logits, *, forward_only: bool) -> list:
        """Run megatron's schedule over `packs`; on the last stage `on_logits(i, logits)` gives micro
        batch i's (loss, metrics) — or, `forward_only`, its result. Returns those on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            output = model(*_sequences(packs[i]))
            if forward_only:  # collect_non_loss_data: the schedule calls it with non_loss_data=True
                return output, lambda logits, non_loss_data: on_logits(i, logits)
            return output, partial(on_logits, i)

        longest = max(p.prompt_ids.shape[1] + p.completion_ids.shape[1] for p in packs)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(len(packs))), model=self.model,
            num_microbatches=len(packs), seq_length=longest, micro_batch_size=self.micro_batch_size,
            forward_only=forward_only, collect_non_loss_data=forward_only,
        )

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The Trainer's probe (`runtime.probe`): the last pipeline stage scores it, every stage
        returns it (collective of the model's ranks; the TP ranks of a stage compute the same values)."""
        return from_last_stage(super().probe_logprobs(token_ids))

    def _score(self, packed) -> torch.Tensor | None:
        """By the forward-only schedule of the KL reference pass; None before the last stage."""
        outputs = self._schedule([packed], lambda i, logits: self._completion_logprobs(packed, logits)[0],
                                 forward_only=True)
        return outputs[0] if outputs else None

    def _completion_logprobs(self, packed, logits: torch.Tensor, with_entropy: bool = False):
        width, steps = packed.prompt_ids.shape[1], packed.completion_ids.shape[1]
        # position width-1 (the prompt's last token) predicts completion token 0
        return token_logprobs(logits[:, width - 1 : width - 1 + steps], packed.completion_ids, self.temperature,
                              with_entropy)

    def _clip_gradients(self) -> torch.Tensor:
        from megatron.core import parallel_state

        if self.world_size > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad.div_(self.world_size)
        grads = [(p.grad, getattr(p, "tp_split", False)) for p in self.params if p.grad is not None]
        split = sum((g.float().pow(2).sum() for g, s in grads if s), torch.zeros((), device=self.device))
        replicated = sum((g.float().pow(2).sum() for g, s in grads if not s), torch.zeros((), device=self.device))
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
        norm = sum_over_pipeline(split + replicated).sqrt()
        coef = (self.algorithm.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
        for g, _ in grads:
            g.mul_(coef)
        return norm


def _sequences(packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each sample's [prompt; completion] ids [B, S], key mask (prompts are left-padded) and, under
    routing replay, routed experts [B, S, MoE layers, top-k] (`pack` fills the padding's)."""
    ids = torch.cat([packed.prompt_ids[packed.prompt_of], packed.completion_ids], dim=1)
    keys = torch.cat([packed.prompt_mask[packed.prompt_of], torch.ones_like(packed.completion_ids)], dim=1)
    routes = None if packed.prompt_routes is None else torch.cat(
        [packed.prompt_routes[packed.prompt_of], packed.completion_routes], dim=1)
    return ids, keys, routes
