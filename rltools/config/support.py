"""What each trainer backend builds, asked of the config alone.

Invariant: light (no torch, no megatron-core): `submit --dry-run` refuses an unsupported config on
the login node, and the trainer asks the same function before it builds anything, so the two
never disagree.
"""

from .schema import RLConfig


def megatron_unsupported(config: RLConfig) -> list[str]:
    """What a config asks of the Megatron backend that it does not build (the model's own
    architecture is checked when the trainer reads its config.json)."""
    t, lora = config.trainer, config.lora
    missing = []
    if not lora.enabled:
        missing.append("full fine-tuning (set lora.enabled: true: this backend trains LoRA adapters)")
    if lora.dropout:
        missing.append("lora.dropout > 0")
    if config.algorithm.mini_batches > 1 and config.algorithm.tis_cap is not None:
        missing.append("algorithm.mini_batches > 1 with algorithm.tis_cap (the proximal logprobs pass)")
    return missing
