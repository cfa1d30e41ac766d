"""Testing helpers that ship with numcoll.

- :func:`run_ranks` / :class:`FakeComm`: an in-memory comm (ranks as
  threads, no transport, no group) to test an algorithm alone, against NumPy,
  at any number of ranks;
- :func:`numcoll.launch`: a function on N real ranks (threads or processes).
"""

from ..launcher import launch
from .fake_comm import WAIT_S, FakeComm, run_ranks

__all__ = ["FakeComm", "run_ranks", "launch", "WAIT_S"]
