"""One optimizer step of GRPO / Dr.GRPO on a step's rollouts, on one trainer rank.

Invariant: advantages are computed over the whole step (every rank sees every sample, so groups
stay whole); each rank then trains on a contiguous block of samples (whole groups where the sizes
allow, so a prompt's forward pass is shared by its samples), and gradients are averaged across
ranks by FSDP2, which equals the single-rank mean because blocks have equal size.
"""

import numpy as np
import torch
import torch.distributed as dist

from ..algorithms.advantages import group_advantages
from ..algorithms.losses import policy_loss
from ..config.schema import AlgorithmConfig
from ..rollout import RolloutBatch
from .logprobs import completion_logprobs, pack
from .model import trainable_parameters


class Trainer:
    def __init__(
        self,
        model,
        algorithm: AlgorithmConfig,
        *,
        micro_batch_size: int,
        max_new_tokens: int,
        pad_id: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        temperature: float = 1.0,
    ):
        self.model = model
        self.algorithm = algorithm
        self.micro_batch_size = micro_batch_size
        self.max_new_tokens = max_new_tokens
        self.pad_id = pad_id
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.group = None  # the data-parallel ranks' process group (None: every rank)
        self.temperature = temperature
        self.params = trainable_parameters(model)
        self.optimizer = torch.optim.AdamW(self.params, lr=algorithm.learning_rate, weight_decay=0.0)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        if len(batch) % self.world_size:
            raise ValueError(f"{len(batch)} samples do not split evenly over {self.world_size} trainer ranks")
        if self.algorithm.routing_replay and batch.routed_experts is None:
            raise ValueError("algorithm.routing_replay: these rollouts carry no routed experts (their generator ran "
                             "without routing replay: the two roles' configs differ)")
        advantages, metrics = group_advantages(
            torch.from_numpy(batch.rewards), torch.from_numpy(batch.group_ids), scale_by_std=self.algorithm.type == "grpo"
        )
        local = np.array_split(np.arange(len(batch)), self.world_size)[self.rank]
        self.model.train()
        sums = self._forward_backward(batch, local, advantages)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(self._mean_over_ranks(sums))
        metrics["grad_norm"] = float(grad_norm)
        metrics["reward_mean"] = float(batch.rewards.mean())
        metrics["accuracy"] = float((batch.rewards > 0.5).mean())
        return metrics

    def _forward_backward(self, batch: RolloutBatch, local: np.ndarray, advantages: torch.Tensor) -> dict[str, float]:
        """Accumulate the gradients of this rank's samples `local`, micro batch by micro batch;
        returns the metrics averaged over them (backends override it)."""
        sums: dict[str, float] = {}
        for start in range(0, len(local), self.micro_batch_size):
            indices = local[start : start + self.micro_batch_size]
            packed = pack(batch, indices, self.pad_id, self.device)
            logprobs, entropy = self._logprobs(packed, with_entropy=True)
            ref = self._reference_logprobs(packed) if self.algorithm.kl_coef > 0 else None
            loss, micro = self._loss(packed, logprobs, entropy, ref, advantages[indices].to(self.device))
            weight = len(indices) / len(local)
            (loss * weight).backward()
            for key, value in micro.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        return sums

    def _loss(self, packed, logprobs, entropy, ref, advantages: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro batch (mean over its samples) and its metrics."""
        loss, metrics = policy_loss(
            logprobs,
            packed.old_logprobs,
            advantages,
            packed.mask,
            clip_low=self.algorithm.clip_eps_low,
            clip_high=self.algorithm.clip_eps_high,
            ref_logprobs=ref,
            kl_coef=self.algorithm.kl_coef,
            token_sum_norm=self.max_new_tokens if self.algorithm.type == "dr_grpo" else None,
            tis_cap=self.algorithm.tis_cap,
        )
        tokens = packed.mask.sum().clamp(min=1)
        metrics["loss"] = float(loss.detach())
        metrics["entropy"] = float((entropy * packed.mask).sum() / tokens)
        metrics["logprob_diff"] = float(((logprobs.detach() - packed.old_logprobs).abs() * packed.mask).sum() / tokens)
        return loss, metrics

    def _logprobs(self, packed, with_entropy: bool = False):
        """Per-token logprobs [B, T] of the completions (and entropies); backends override it."""
        return completion_logprobs(self.model, packed, self.temperature, with_entropy=with_entropy)

    def _clip_gradients(self) -> torch.Tensor:
        """Clip to algorithm.max_grad_norm; returns the norm before clipping (backends override it)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.algorithm.max_grad_norm)
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    @torch.no_grad()
    def _reference_logprobs(self, packed) -> torch.Tensor:
        with self.model.disable_adapter():
            return self._logprobs(packed)[0]

    def _mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return values
        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.group)
        return {k: float(v) / self.world_size for k, v in zip(keys, tensor)}
