"""``python -m numcoll.bench``: see :mod:`numcoll.bench.cli`."""

# Rank processes are spawned: they re-import this module as __mp_main__, so
# the benchmark must only start under the guard.
if __name__ == "__main__":
    import sys

    from . import main

    sys.exit(main())
