"""``nc.flight_recorder``: the last N collectives of this process, with their
state (see :mod:`numcoll.diagnostics.flight_recorder` for the fields)."""

from .diagnostics.flight_recorder import dump, dump_json, enabled

__all__ = ["dump", "dump_json", "enabled"]
