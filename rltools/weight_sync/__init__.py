"""Weight sync: trainer rank 0 broadcasts each new policy version to every generator worker.

`rendezvous` forms the authenticated group (TCPStore on trainer rank 0, run secret), `channel`
moves named tensors over it (`rltools bench weights` measures it against a plain broadcast).
"""

from .channel import StaleVersionError, TensorStream, Transfer, WeightSender
from .receiver import WeightReceiver
from .rendezvous import SyncGroup, SyncOptions, host_group, join_group
from .store import WeightSyncError, bound_store

__all__ = [
    "StaleVersionError",
    "SyncGroup",
    "SyncOptions",
    "TensorStream",
    "Transfer",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "bound_store",
    "host_group",
    "join_group",
]
