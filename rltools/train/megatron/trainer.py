"""The GRPO step on a Megatron policy: the FSDP2 Trainer's step with two backend parts replaced.

- Logprobs: one full-sequence forward of [prompt; completion] per sample (Megatron's GPTModel has
  no Hugging Face KV-cache interface to share a prompt's forward pass between its samples).
- Gradient clipping: the norm sums the squares of TP-split adapters over the TP group and counts
  replicated ones once, so it equals the unsharded model's norm.

Every TP rank runs the same samples (no data parallelism yet: the Trainer gets rank 0 of 1).
"""

import torch
import torch.distributed as dist

from ..logprobs import token_logprobs
from ..trainer import Trainer


class MegatronTrainer(Trainer):
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
