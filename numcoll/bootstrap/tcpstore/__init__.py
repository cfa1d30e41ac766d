"""TCPStore: a key-value store served over TCP by the master rank, in numcoll's
protocol and in torch.distributed's.

- :mod:`.protocol`: the wire formats, the opening that tells the two protocols
  apart, the token handshake's proofs, the errors;
- :mod:`.server`: the master's one-thread server (numcoll's requests, parking,
  deadlines, limits, refusals);
- :mod:`.torch_wire`: torch's ``TCPStore`` queries, served by the same server
  on the same keys;
- :mod:`.client`: :class:`TCPStore`, the client every rank holds.
"""

from .client import TCPStore
from .protocol import StoreAuthError, StoreConnectionError

__all__ = ["TCPStore", "StoreConnectionError", "StoreAuthError"]
