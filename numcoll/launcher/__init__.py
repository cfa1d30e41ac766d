"""Running ranks: :func:`numcoll.launch` (a function on N local ranks, as threads
or processes: :mod:`.local`), ``numcoll run`` (a script on N local ranks,
torchrun-style: :mod:`.run`) and the one way a rank dies with its parent."""

from .local import LaunchError, LaunchTimeoutError, RankFailedError, launch

__all__ = ["launch", "RankFailedError", "LaunchError", "LaunchTimeoutError"]
