"""The GRPO step on a Megatron policy: the FSDP2 Trainer's step with two backend parts replaced.

- Logprobs: one full-sequence forward of [prompt; completion] per sample (Megatron's GPTModel has
  no Hugging Face KV-cache interface to share a prompt's forward pass between its samples).
- Gradients: averaged over the data-parallel group first (each DP rank trains on its block of the
  step's samples, as FSDP2 ranks do); the clipping norm then sums the squares of TP-split adapters
  over the TP group and counts replicated ones once, so it equals the unsharded model's norm.

The Trainer's rank and world size are the data-parallel ones: the TP ranks of one model replica
run the same samples. Metrics are averaged over the DP group only.
"""

import torch
import torch.distributed as dist

from ..logprobs import token_logprobs
from ..trainer import Trainer


class MegatronTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.world_size > 1:
            from megatron.core import parallel_state

            self.group = parallel_state.get_data_parallel_group()  # metrics and gradients: DP ranks only

    def _logprobs(self, packed, with_entropy: bool = False):
        ids = torch.cat([packed.prompt_ids[packed.prompt_of], packed.completion_ids], dim=1)
        keys = torch.cat([packed.prompt_mask[packed.prompt_of], torch.ones_like(packed.completion_ids)], dim=1)
        logits = self.model(ids, keys)
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
        split = sum((g.float().pow(2).sum() for g, s in grads if s), torch.zeros(()))
        replicated = sum((g.float().pow(2).sum() for g, s in grads if not s), torch.zeros(()))
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
        norm = (split + replicated).sqrt()
        coef = (self.algorithm.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
        for g, _ in grads:
            g.mul_(coef)
        return norm
