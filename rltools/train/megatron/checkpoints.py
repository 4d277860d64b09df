"""Checkpoints of the Megatron backend, in the FSDP2 backend's format.

What is saved is what `rltools.train.checkpoints` saves for a peft model: the LoRA adapters under peft's
parameter names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`) and
their AdamW moments, as full tensors — gathered over TP before the save, split again at load; each
pipeline stage saves and loads its own layers' adapters (global layer numbers, so the keys of the
stages never collide). So a checkpoint written at one TP or PP degree resumes at any other (or on
FSDP2); the adapters are small, so gathering them costs little. Everything else (atomic
directories, markers, RNG, keep-last-K) is `rltools.train.checkpoints`'s.

AdamW's settings (weight decay, betas, eps) are saved with the view's param groups, as FSDP2 saves
them, but a load keeps the optimizer's own: they are the run's config, which a resume cannot change
(`launch.run_dir.RESUMABLE`), and the learning rate is set from the schedule before every update.
"""

import torch
from torch import nn

from .. import checkpoints
from .model import MegatronPolicy
from .parallel import gather, tp_rank_size

MOMENTS = ("exp_avg", "exp_avg_sq")


def save(paths, step: int, policy: MegatronPolicy, optimizer, *, rank: int, keep: int):
    view, view_optimizer, _ = _full_view(policy, optimizer)
    return checkpoints.save(paths, step, view, view_optimizer, rank=rank, keep=keep)


def load(paths, step: int, policy: MegatronPolicy, optimizer, *, rank: int) -> dict:
    view, view_optimizer, pairs = _full_view(policy, optimizer)
    meta = checkpoints.load(paths, step, view, view_optimizer, rank=rank)
    tp_rank, tp_size = tp_rank_size()

    def local(full: torch.Tensor, dim: int | None) -> torch.Tensor:
        return full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank].clone()

    with torch.no_grad():
        for param, full, dim in pairs:
            param.copy_(local(full, dim))
            saved = view_optimizer.state[full]
            optimizer.state[param] = {"step": saved["step"].clone(),
                                      **{k: local(saved[k], dim) for k in MOMENTS}}
    return meta


def _full_view(policy: MegatronPolicy, optimizer):
    """A plain module of full adapter tensors under peft's names, an AdamW over it holding the full
    moments, and (local parameter, full parameter, split dim) triples (collective over TP)."""
    view, pairs = nn.Module(), []
    for name, param, dim in policy.adapter_params():
        full = nn.Parameter(gather(param, dim).clone())
        _set(view, name.replace(".weight", ".default.weight"), full)
        pairs.append((param, full, dim))
    # the optimizer's hyperparameters as they are now (not its defaults): the FSDP2 backend restores them
    view_optimizer = torch.optim.AdamW(view.parameters(), **{k: v for k, v in optimizer.param_groups[0].items()
                                                            if k in ("lr", "weight_decay", "betas", "eps")})
    for param, full, dim in pairs:
        state = optimizer.state.get(param, {})
        view_optimizer.state[full] = {
            "step": state["step"].clone() if "step" in state else torch.tensor(0.0),
            **{k: gather(state[k], dim) if k in state else torch.zeros_like(full) for k in MOMENTS},
        }
    return view, view_optimizer, pairs


def _set(root: nn.Module, dotted: str, param: nn.Parameter) -> None:
    *parents, leaf = dotted.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)
