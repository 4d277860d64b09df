"""The stores of the weight-sync rendezvous: trainer rank 0's TCPStore bound to one address, and the
sealed view of it that a group's own rendezvous records go through (`rendezvous` says why).
"""

import hashlib
import hmac
import socket
from datetime import timedelta

import torch.distributed as dist


class WeightSyncError(RuntimeError):
    """The weight-sync group could not form, or one of its collectives failed or timed out."""


def bound_store(address: str, timeout: timedelta):
    """A TCPStore server listening on `address` only, on a free port (`store.port`).

    TCPStore alone listens on every interface whatever host it is given; a socket bound here and
    handed over keeps it off the interfaces nobody was told about (on a login-free compute node that
    still matters: other users' jobs share the nodes)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(512)
        port = listener.getsockname()[1]
        store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store serves on this descriptor now: Python must not close it
    return store


class SealedStore(dist.Store):
    """A view of `inner` whose key names are keyed hashes and whose values carry an HMAC tag.

    Used only for the process group's own rendezvous (a few small address records), so the
    per-call cost of a Python store does not matter.
    """

    def __init__(self, inner, key: bytes, timeout: timedelta, label: str = ""):
        super().__init__()
        self._inner, self._key, self._timeout = inner, key, timeout
        self._label = label.encode()  # a generation's records never meet another's

    def _name(self, key: str) -> str:
        return "g/" + hmac.new(self._key, b"name|" + self._label + b"|" + key.encode(), hashlib.sha256).hexdigest()[:40]

    def _tag(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"|" + value, hashlib.sha256).digest()

    def set(self, key, value):
        name, value = self._name(key), value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(name, value + self._tag(name, value))

    def get(self, key):
        name = self._name(key)
        self._inner.wait([name], self._timeout)
        blob = self._inner.get(name)
        value, tag = blob[:-32], blob[-32:]
        if not hmac.compare_digest(tag, self._tag(name, value)):
            raise WeightSyncError(f"weight-sync: the group's rendezvous record {key!r} failed authentication: "
                                  "a process without the run secret is writing to trainer rank 0's store")
        return value

    def add(self, key, amount):
        return self._inner.add(self._name(key), amount)  # a forged counter can only stall: named timeout

    def check(self, keys):
        return self._inner.check([self._name(k) for k in keys])

    def wait(self, keys, timeout=None):
        # Capped at the join deadline: the group's rendezvous must not outlive it.
        limit = timeout if timeout and timeout < self._timeout else self._timeout
        self._inner.wait([self._name(k) for k in keys], limit)

    def delete_key(self, key):
        return self._inner.delete_key(self._name(key))

    def set_timeout(self, timeout):
        self._timeout = timeout
