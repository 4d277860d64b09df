"""Environments: what answers the model between its turns (`env.type`). See `base.Environment`."""

from ..config.schema import EnvConfig
from .base import Environment, Reply, SingleTurn

__all__ = ["Environment", "Reply", "make_environment"]


def make_environment(config: EnvConfig) -> Environment:
    """A fresh environment for `env.type` (one per concurrent episode)."""
    if config.type == "single_turn":
        return SingleTurn()
    # Here, not in base.py: tools.py imports base, and a lazy import back from base is a module cycle.
    from .tools import ToolEnvironment

    return ToolEnvironment(config)
