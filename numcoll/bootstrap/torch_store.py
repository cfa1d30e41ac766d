"""numcoll :class:`~numcoll.bootstrap.store.Store` views of torch.distributed stores.

- :class:`TorchStore` wraps any torch ``Store`` object (``TCPStore``,
  ``HashStore``, ``FileStore``, ``PrefixStore``...): the numcoll backend of
  torch.distributed (:mod:`numcoll.torch`) is handed one by torch and builds
  its numcoll group on it.
- :class:`TorchAgentStore` is a client of the torch ``TCPStore`` that torchrun's
  agent serves at ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``):
  every rank is meant to be a client of that store, which speaks torch's
  protocol. torch is necessarily installed there (torchrun is part of it).

torch is imported only when one of them is made.
"""

from __future__ import annotations

import datetime

from .store import Store, StoreTimeoutError, _ms

__all__ = ["TorchStore", "TorchAgentStore"]


class TorchStore(Store):
    """A numcoll store over the torch store object ``store`` (used, never closed).

    Parameters
    ----------
    store : torch.distributed.Store
        Any torch store; keys and values pass through unchanged.
    timeout : datetime.timedelta, optional
        Default deadline of ``get``/``wait``; default: the torch store's own.
    where : str, optional
        How errors name the store (default: its repr).
    """

    def __init__(self, store, timeout: datetime.timedelta | None = None, where: str = ""):
        import torch.distributed as torch_dist

        super().__init__(timeout if timeout is not None else store.timeout)
        self._store = store
        self._where = where or f"torch {type(store).__name__}"
        # A torch wait that passes its deadline raises DistStoreError (older
        # versions: RuntimeError); anything else is the store's own failure.
        self._timeout_errors = tuple(e for e in (getattr(torch_dist, "DistStoreError", None),)
                                     if e is not None) or (RuntimeError,)

    @property
    def torch_store(self):
        """The torch store this one reads and writes."""
        return self._store

    def __repr__(self) -> str:
        return f"TorchStore({self._where})"

    def _timeout(self, keys, timeout, exc) -> StoreTimeoutError:
        return StoreTimeoutError(f"Timed out waiting {_ms(timeout)}ms for keys {keys} in "
                                 f"{self._where}: {exc}", keys, timeout)

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
        except self._timeout_errors as exc:
            raise self._timeout(keys, timeout, exc) from None

    def _check(self, keys):
        return bool(self._store.check(keys))

    def _delete_key(self, key):
        return bool(self._store.delete_key(key))

    def _num_keys(self):
        return int(self._store.num_keys())


class TorchAgentStore(TorchStore):
    """A client of the torch TCPStore at ``host:port`` (never its server)."""

    def __init__(self, host: str, port: int, timeout: datetime.timedelta):
        import torch.distributed as torch_dist

        self._host, self._port = host, port
        client = torch_dist.TCPStore(host, port, is_master=False, timeout=timeout)
        super().__init__(client, timeout, where=f"torchrun's TCPStore at {host}:{port}")

    @property
    def host(self) -> str:
        """The host of torchrun's store (MASTER_ADDR)."""
        return self._host

    def __repr__(self) -> str:
        return f"TorchAgentStore({self._host}:{self._port})"
