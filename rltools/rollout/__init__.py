"""Rollouts: the typed RolloutBatch and its HDF5 hand-off from generators to trainers."""

from .batch import FinishReason, RolloutBatch, Sample
from .shard import SCHEMA_VERSION, ShardError
from .store import RolloutStore, RolloutTimeout

__all__ = ["FinishReason", "RolloutBatch", "RolloutStore", "RolloutTimeout", "SCHEMA_VERSION", "Sample", "ShardError"]
