"""``python -m numcoll.fr DIR``: analyse the flight-recorder dumps in DIR
(see :mod:`numcoll.diagnostics.fr_trace`)."""

from .diagnostics.fr_trace import main

if __name__ == "__main__":
    raise SystemExit(main())
