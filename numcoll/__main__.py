"""``python -m numcoll`` / the ``numcoll`` command: ``run``, ``demo``, ``bench``."""

from __future__ import annotations

import sys

from ._version import __version__

_HELP = f"""\
numcoll {__version__}: the collectives of PyTorch's Gloo backend over NumPy arrays.

usage: numcoll <command> [options]        (or: python -m numcoll <command> ...)

commands:
  run     start N ranks of a script with torchrun's environment
            numcoll run -n 4 train.py --lr 0.1
            numcoll run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -n 4 train.py
  demo    every collective on 4 local ranks, checked, then timed
  bench   nccl-tests-style sweeps (optionally beside torch's gloo)

numcoll <command> --help says more. Logging: NUMCOLL_LOG_LEVEL=INFO (or NUMCOLL_DEBUG=1).
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; with none (or --help) print the help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_HELP, end="")
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"numcoll {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from .launcher.run import main as run_main

        return run_main(rest)
    if command == "demo":
        from .bench.demo import main as demo_main

        return demo_main(rest) or 0
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest) or 0
    print(f"numcoll: unknown command {command!r}\n", file=sys.stderr)
    print(_HELP, end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
