"""Typed run configuration: `load_config(path, overrides)` -> `RLConfig`."""

from .loader import dump_config, load_config
from .schema import RLConfig

__all__ = ["RLConfig", "dump_config", "load_config"]
