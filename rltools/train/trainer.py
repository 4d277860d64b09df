"""The policy update on a step's rollouts, on one trainer rank: `algorithm.mini_batches` optimizer
steps of the objective `algorithm.type` names (rltools.algorithms.losses).

Invariant: advantages are computed over the whole step (every rank sees every sample, so groups
stay whole); each rank then trains on a contiguous block of samples (whole groups where the sizes
allow, so a prompt's forward pass is shared by its samples), split into the same number of
mini-batches on every rank, and gradients are averaged across ranks by FSDP2, which equals the
single-rank mean because blocks have equal size. With several mini-batches and `tis_cap`, the
proximal logprobs (the trainer's before the first update) are computed once, before it.

The learning rate of each optimizer update is `lr_schedule.rate_at` of its number in the run,
counted from `steps_done` (the steps trained, which a checkpoint's step restores: `Backend.load`).
"""

import numpy as np
import torch
import torch.distributed as dist

from ..algorithms.advantages import group_advantages, overlong_penalty
from ..algorithms.losses import policy_loss
from ..config.lr_schedule import rate_at
from ..config.schema import AlgorithmConfig
from ..rollout import FinishReason, RolloutBatch, Sample
from .logprobs import completion_logprobs, pack
from .model import trainable_parameters
from .recipes import recipe


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
        total_steps: int | None = None,
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
        self._proximal: np.ndarray | None = None  # this step's proximal logprobs, when computed
        self._tokens_per_sample = 1.0  # the current mini-batch's, for the "token" aggregation
        assert total_steps or algorithm.lr_schedule == "constant", "a decaying learning rate needs the run's length"
        self.total_steps = total_steps  # schedule.steps
        self.steps_done = 0
        """Steps trained so far in the run: the learning-rate schedule's clock (a checkpoint restores it)."""
        self.optimizer = torch.optim.AdamW(self.params, lr=algorithm.learning_rate, weight_decay=algorithm.weight_decay,
                                           betas=(algorithm.adam_beta1, algorithm.adam_beta2), eps=algorithm.adam_eps)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        if len(batch) % self.world_size:
            raise ValueError(f"{len(batch)} samples do not split evenly over {self.world_size} trainer ranks")
        if self.algorithm.routing_replay and batch.routed_experts is None:
            raise ValueError("algorithm.routing_replay: these rollouts carry no routed experts (their generator ran "
                             "without routing replay: the two roles' configs differ)")
        algorithm = self.algorithm
        advantages, metrics = self.advantages(batch)
        local = np.array_split(np.arange(len(batch)), self.world_size)[self.rank]
        self._proximal = None
        if algorithm.tis_cap is not None and algorithm.mini_batches > 1:
            self._proximal = self._proximal_logprobs(batch, local)
        self.model.train()
        sums: dict[str, float] = {}
        norms, rates = [], []
        minis = np.array_split(local, algorithm.mini_batches)
        for i, mini in enumerate(minis):
            rates.append(self._set_learning_rate(self.steps_done * algorithm.mini_batches + i))
            self._tokens_per_sample = self._mean_tokens(batch, mini)
            for key, value in self._forward_backward(batch, mini, advantages).items():
                sums[key] = sums.get(key, 0.0) + value / len(minis)
            norms.append(float(self._clip_gradients()))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        metrics.update(self._mean_over_ranks(sums))
        metrics["grad_norm"] = sum(norms) / len(norms)
        metrics["lr"] = sum(rates) / len(rates)
        self.steps_done += 1
        if algorithm.overlong != "none":
            metrics["truncated_frac"] = float((batch.finish_reasons == FinishReason.LENGTH).mean())
        metrics["reward_mean"] = float(batch.rewards.mean())
        metrics["accuracy"] = float((batch.rewards > 0.5).mean())
        if batch.episodes:  # multi-turn: how the policy uses its tools
            calls = int(batch.tool_calls.sum())
            metrics["tool_call_rate"] = float((batch.tool_calls > 0).mean())  # samples that called a tool
            metrics["tool_error_rate"] = float(batch.tool_errors.sum() / calls) if calls else 0.0  # per call
            metrics["turns_mean"] = float(batch.turns.mean())
        return metrics

    def advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's advantages [N] (over the whole batch: groups stay whole) and their metrics: the
        group-relative advantages of the rewards, DAPO's overlong penalty added under `overlong: penalty`."""
        rewards = torch.from_numpy(batch.rewards)
        if self.algorithm.overlong == "penalty":
            lengths = torch.from_numpy(np.diff(batch.completion_offsets))
            rewards = rewards + overlong_penalty(lengths, self.max_new_tokens, self.algorithm.overlong_buffer)
        return group_advantages(rewards, torch.from_numpy(batch.group_ids),
                                scale_by_std=recipe(self.algorithm).scale_by_std)

    def _set_learning_rate(self, update: int) -> float:
        """Give the optimizer the learning rate of update `update` of the run; returns it."""
        lr = rate_at(self.algorithm, self.total_steps, update)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _forward_backward(self, batch: RolloutBatch, local: np.ndarray, advantages: torch.Tensor) -> dict[str, float]:
        """Accumulate the gradients of this rank's samples `local`, micro batch by micro batch;
        returns the metrics averaged over them (backends override it)."""
        sums: dict[str, float] = {}
        for start in range(0, len(local), self.micro_batch_size):
            indices = local[start : start + self.micro_batch_size]
            packed = self._pack(batch, indices)
            logprobs, entropy = self._logprobs(packed, with_entropy=True)
            ref = self._reference_logprobs(packed) if self.algorithm.kl_coef > 0 else None
            loss, micro = self._loss(packed, logprobs, entropy, ref, advantages[indices].to(self.device))
            weight = len(indices) / len(local)
            (loss * weight).backward()
            for key, value in micro.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        return sums

    def _pack(self, batch: RolloutBatch, indices: np.ndarray):
        """One micro batch as tensors, with the proximal logprobs when the step computed them and
        without the truncated answers' tokens under `overlong: mask`."""
        return pack(batch, indices, self.pad_id, self.device, proximal=self._proximal,
                    drop_truncated=self.algorithm.overlong == "mask")

    @torch.no_grad()
    def _proximal_logprobs(self, batch: RolloutBatch, local: np.ndarray) -> np.ndarray:
        """The trainer's logprobs of `local`'s completion tokens before this step's first update, laid
        out like `batch.completion_logprobs` (other samples' entries stay 0)."""
        self.model.eval()
        out = np.zeros_like(batch.completion_logprobs)
        for start in range(0, len(local), self.micro_batch_size):
            indices = local[start : start + self.micro_batch_size]
            packed = pack(batch, indices, self.pad_id, self.device)
            logprobs = self._logprobs(packed)[0].float().cpu().numpy()
            for row, i in enumerate(indices):
                begin, end = batch.completion_offsets[i], batch.completion_offsets[i + 1]
                out[begin:end] = logprobs[row, : end - begin]
        return out

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """The policy's log-probability of each of `token_ids` after the ones before it, at temperature
        1 (what vLLM's prompt logprobs are): len(token_ids) - 1 values; None on a rank that computes
        no logits (`_score`). A collective of the trainers."""
        sample = Sample(prompt_ids=token_ids[:1], completion_ids=token_ids[1:], completion_logprobs=[0.0] * (len(token_ids) - 1),
                        reward=0.0, group_id=0, sample_index=0, finish_reason=FinishReason.STOP)
        packed = pack(RolloutBatch.from_samples([sample], policy_version=0), np.arange(1), self.pad_id, self.device)
        self.model.eval()
        temperature, self.temperature = self.temperature, 1.0
        try:
            logprobs = self._score(packed)
        finally:
            self.temperature = temperature
        return None if logprobs is None else logprobs[0, : len(token_ids) - 1].float().cpu().tolist()

    def _score(self, packed) -> torch.Tensor | None:
        """The completion logprobs [B, steps] of one packed micro batch, forward only."""
        return self._logprobs(packed)[0]

    def _mean_tokens(self, batch: RolloutBatch, samples: np.ndarray) -> float:
        """Completion tokens per sample in `samples` that enter the loss (the "token" aggregation's budget)."""
        lengths = np.array([batch.trained_mask(i).sum() for i in samples])  # an environment's tokens excepted
        if self.algorithm.overlong == "mask":
            lengths = lengths * (batch.finish_reasons[samples] != FinishReason.LENGTH)
        return max(float(lengths.mean()), 1e-6) if len(samples) else 1.0

    def _loss(self, packed, logprobs, entropy, ref, advantages: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro batch (weighted by its share of the mini-batch's samples) and
        its metrics."""
        parts = recipe(self.algorithm)
        budget = {"budget": self.max_new_tokens, "token": self._tokens_per_sample}.get(parts.aggregation)
        loss, metrics = policy_loss(
            logprobs,
            packed.old_logprobs,
            advantages,
            packed.mask,
            clip_low=parts.clip_low,
            clip_high=parts.clip_high,
            objective=parts.objective,
            aggregation=parts.aggregation,
            budget=budget,
            ref_logprobs=ref,
            kl_coef=self.algorithm.kl_coef,
            tis_cap=self.algorithm.tis_cap,
            proximal_logprobs=packed.proximal_logprobs,
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
