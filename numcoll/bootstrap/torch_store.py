"""A numcoll :class:`~numcoll.bootstrap.store.Store` over a torch ``TCPStore`` client.

Under torchrun the agent serves a torch TCPStore at ``MASTER_ADDR:MASTER_PORT``
and sets ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank is meant to be a
client of that store, which speaks torch's protocol, not numcoll's. This
adapter lets numcoll's rendezvous and groups use it. torch is necessarily
installed there (torchrun is part of it) and is imported only then.
"""

from __future__ import annotations

import datetime

from .store import Store, StoreTimeoutError

__all__ = ["TorchAgentStore"]


class TorchAgentStore(Store):
    """A client of the torch TCPStore at ``host:port`` (never its server)."""

    def __init__(self, host: str, port: int, timeout: datetime.timedelta):
        super().__init__(timeout)
        import torch.distributed as torch_dist

        self._host, self._port = host, port
        self._errors = tuple(e for e in (getattr(torch_dist, "DistStoreError", None),
                                         RuntimeError) if e is not None)
        self._store = torch_dist.TCPStore(host, port, is_master=False, timeout=timeout)

    @property
    def host(self) -> str:
        """The host of torchrun's store (MASTER_ADDR)."""
        return self._host

    def __repr__(self) -> str:
        return f"TorchAgentStore({self._host}:{self._port})"

    def _timeout(self, keys, timeout, exc):
        ms = int(timeout.total_seconds() * 1000)
        return StoreTimeoutError(f"Timed out waiting {ms}ms for keys {keys} in torchrun's "
                                 f"TCPStore at {self._host}:{self._port}: {exc}", keys, timeout)

    def _set(self, key, value):
        self._store.set(key, value)

    def _get(self, key, timeout):
        self._wait([key], timeout)
        return bytes(self._store.get(key))

    def _add(self, key, amount):
        return int(self._store.add(key, amount))

    def _compare_set(self, key, expected, desired):
        return bytes(self._store.compare_set(key, expected, desired))

    def _wait(self, keys, timeout):
        try:
            self._store.wait(keys, timeout)
        except self._errors as exc:
            raise self._timeout(keys, timeout, exc) from None

    def _check(self, keys):
        return bool(self._store.check(keys))

    def _delete_key(self, key):
        return bool(self._store.delete_key(key))

    def _num_keys(self):
        return int(self._store.num_keys())
