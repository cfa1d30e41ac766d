"""The flight recorder: the last N collectives of this process, with their state.

Like torch's (``TORCH_FR_BUFFER_SIZE``, ``_dump_fr_trace``), it keeps a ring of
records — one per collective, created when the call is queued and updated when
it starts, while it waits for a peer, and when it ends — so that after a hang
or a failure each rank can say what it was doing and whom it waited for.

``NUMCOLL_FR_BUFFER_SIZE=N`` (read when the first group is created) keeps the
last N records per process (default 2000; 0 turns the recorder off). When a
group is poisoned (a timeout, a dead peer, a mismatch) and
``NUMCOLL_FR_DUMP_DIR`` is set, the rank writes its records there as
``numcoll_fr_rank{rank}.json``; ``python -m numcoll.diagnostics.fr_trace DIR`` merges the ranks'
dumps and says which rank is missing from which collective. A dump directory
may be shared with other users: the file is created new (``O_EXCL``, never
through a link, mode 0600) under a random name and renamed into place, so
nothing planted there is followed or overwritten through, and a reader never
sees half a file.

A group's configuration and progress are kept while the group lives and,
once it is shut down (:meth:`FlightRecorder.release_group`), only while some
of its records are still in the ring: creating and destroying groups forever
does not grow the recorder.

Times are ``time.time_ns()`` (wall clock), so records of ranks in different
processes line up on one timeline.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time
import uuid

import numpy as np

from .. import config
from ..call import TORCH_NAMES

__all__ = ["dump", "dump_json", "enabled", "FlightRecorder", "Lane", "Record", "write_private"]

VERSION = "1.0"
_now_ns = time.time_ns


class Record:
    """One collective's entry. Fields are written by the thread running it."""

    __slots__ = ("record_id", "pg_id", "rank", "seq", "call", "state", "time_created_ns",
                 "time_started_ns", "time_completed_ns", "waiting_for", "waiting_op", "error",
                 "algorithm")

    def __init__(self, record_id: int, pg_id: int, rank: int, seq: int, call):
        self.record_id = record_id
        self.pg_id = pg_id
        self.rank = rank
        self.seq = seq
        self.call = call
        self.state = "scheduled"
        self.time_created_ns = _now_ns()
        self.time_started_ns = None
        self.time_completed_ns = None
        #: While started: the peer it waits for, and how ("recv", "send", or
        #: "arena": a shared-arena step, which waits for every rank).
        self.waiting_for = None
        self.waiting_op = None
        self.error = None
        #: What ran, when it is not the call's algorithm (a fallback): see
        #: :meth:`numcoll.comm.Comm.ran_instead`.
        self.algorithm = None

    def describe_wait(self) -> str | None:
        """``allreduce (collective #3) waiting to recv from rank 1``, while it waits."""
        op, peer = self.waiting_op, self.waiting_for
        if op is None:
            return None
        what = (f"{self.call.name} (collective #{self.seq})" if self.seq > 0
                else f"{self.call.name} (point-to-point)")
        if op == "arena":
            return f"{what} waiting for every rank at a shared-arena step"
        return f"{what} waiting to {op} {'from' if op == 'recv' else 'to'} rank {peer}"

    def as_dict(self) -> dict:
        call = self.call
        dtype = [] if call.dtype is None else [_dtype_name(call.dtype)]
        return {
            "record_id": self.record_id,
            "pg_id": self.pg_id,
            "rank": self.rank,
            # A group's collectives are numbered from 1, as torch numbers them
            # (and as numcoll's errors say "collective #N"); point-to-point ops
            # have none.
            "collective_seq_id": self.seq if self.seq > 0 else None,
            "profiling_name": f"numcoll:{TORCH_NAMES.get(call.name, call.name)}",
            "input_sizes": [list(s) for s in call.input_sizes],
            "input_dtypes": dtype * len(call.input_sizes),
            "output_sizes": [list(s) for s in call.output_sizes],
            "output_dtypes": dtype * len(call.output_sizes),
            "state": self.state,
            "time_created_ns": self.time_created_ns,
            "time_started_ns": self.time_started_ns,
            "time_completed_ns": self.time_completed_ns,
            "timeout_ms": round(call.timeout_s * 1000),
            "algorithm": self.algorithm or call.algorithm or None,
            "waiting_for": self.waiting_for,
            "nbytes": call.nbytes,
            "root": call.root if call.root >= 0 else None,
            "op": call.op,
            "error": self.error,
        }


def _dtype_name(dtype) -> str:
    from ..dtypes import dtype_name

    return dtype_name(dtype)

#: A lane row's states (written by compiled code: :mod:`numcoll.collectives.fused_step`).
_LANE_STATES = {1: "started", 2: "completed"}
#: At most this many rows per lane, and this many lanes per recorder (the oldest go).
LANE_ROWS = 1024
MAX_LANES = 256


class Lane:
    """The records of one repeated call (a persistent request, or a blocking
    call the group recognised as a repeat), kept as rows of int64 that its
    compiled step writes: ``rows[i] = (seq, started, completed, state)``,
    times on the monotonic clock. No :class:`Record` is made per call; the
    dump turns rows into entries. A call that leaves the compiled step (a
    slow peer, a failure) marks its row moved and gets a Record instead.

    ``meta[0]`` counts the rows written, ``meta[1]`` is the last one's index.
    ``algorithm``: what every completed row ran, where the step does one way
    of the call's algorithm (a fused single-copy start copies); None: the
    call's algorithm.
    """

    __slots__ = ("pg_id", "rank", "call", "rows", "meta", "algorithm", "_offset_ns")

    def __init__(self, pg_id: int, rank: int, call, rows: np.ndarray, meta: np.ndarray):
        self.pg_id, self.rank, self.call = pg_id, rank, call
        self.rows, self.meta = rows, meta
        self.algorithm = None
        self._offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall

    def last_row(self) -> np.ndarray:
        """The row of the last call written."""
        return self.rows[self.meta[1]]

    def records(self) -> list[Record]:
        """The rows as (detached) :class:`Record` objects, oldest first."""
        n = int(self.meta[0])
        count = min(n, len(self.rows))
        out = []
        for k in range(n - count, n):
            seq, started, completed, state = (int(v) for v in self.rows[k % len(self.rows)])
            what = _LANE_STATES.get(state)
            if what is None:  # moved to a Record, or not written yet
                continue
            rec = Record(-1, self.pg_id, self.rank, seq, self.call)
            rec.time_created_ns = rec.time_started_ns = started + self._offset_ns
            rec.state = what
            if what == "completed":
                rec.time_completed_ns = completed + self._offset_ns
                rec.algorithm = self.algorithm
            else:
                rec.waiting_op = "arena"
            out.append(rec)
        return out


class FlightRecorder:
    """A bounded ring of :class:`Record` plus each group's configuration and progress."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._records: collections.deque[Record] = collections.deque(maxlen=capacity)
        self._ids = itertools.count()
        self._pg_ids = itertools.count()
        self._lock = threading.Lock()
        self._pg_config: dict[int, dict] = {}
        self._pg_status: dict[int, list] = {}
        self._released: set[int] = set()  # shut down; dropped once no record names them
        self._lanes: collections.deque[Lane] = collections.deque(maxlen=MAX_LANES)

    def register_group(self, name: str, desc: str, ranks: list[int]) -> int:
        """A new group's id (``pg_id`` in the records)."""
        with self._lock:
            pg_id = next(self._pg_ids)
            self._pg_config[pg_id] = {"name": name, "desc": desc, "ranks": list(ranks)}
            # last enqueued, started, completed collective_seq_id (-1: none yet)
            self._pg_status[pg_id] = [-1, -1, -1]
        return pg_id

    def set_group_ranks(self, pg_id: int, ranks: list[int]) -> None:
        with self._lock:
            config = self._pg_config.get(pg_id)
            if config is not None:
                config["ranks"] = list(ranks)

    def release_group(self, pg_id: int) -> None:
        """The group ``pg_id`` was shut down: forget its configuration and
        progress once none of its records is left in the ring (and those of
        groups released earlier whose records have since been pushed out)."""
        with self._lock:
            self._released.add(pg_id)
            # list() copies the ring in C, safe against a concurrent append.
            named = {rec.pg_id for rec in list(self._records)}
            named.update(lane.pg_id for lane in self._lanes if lane.meta[0])
            for gone in [g for g in self._released if g not in named]:
                self._released.discard(gone)
                self._pg_config.pop(gone, None)
                self._pg_status.pop(gone, None)

    # The three calls below run on every collective: no lock (a deque append and
    # an itertools.count step are atomic under the GIL; a status read racing an
    # update sees the old or the new number), one clock read each. A group's
    # status may be gone (work finishing after its group was released).
    def record(self, pg_id: int, rank: int, seq: int, call, started: bool = False) -> Record:
        """A new record for collective ``seq`` (scheduled; or ``started`` at once,
        for a call its caller runs right away)."""
        rec = Record(next(self._ids), pg_id, rank, seq, call)
        self._records.append(rec)
        status = self._pg_status.get(pg_id)
        if seq > 0 and status is not None:
            status[0] = seq
        if started:  # started(rec), without a second clock read and status lookup
            rec.state = "started"
            rec.time_started_ns = rec.time_created_ns
            if status is not None and seq > status[1]:
                status[1] = seq
        return rec

    def lane_rows(self) -> int:
        """How many rows a :class:`Lane` keeps."""
        return max(1, min(self.capacity, LANE_ROWS))

    def lane(self, pg_id: int, rank: int, call, rows: np.ndarray, meta: np.ndarray) -> Lane:
        """A new :class:`Lane` for the repeated ``call`` of group ``pg_id``, over
        ``rows`` (``lane_rows()`` rows of four int64) and ``meta`` (two)."""
        lane = Lane(pg_id, rank, call, rows, meta)
        with self._lock:
            self._lanes.append(lane)
        return lane

    def _all_records(self) -> list[Record]:
        """The ring's records and the lanes', in time order, the last ``capacity``
        (under the lock)."""
        records = list(self._records)
        lanes = [lane for lane in self._lanes if lane.meta[0]]
        if not lanes:
            return records
        for lane in lanes:
            records.extend(lane.records())
        records.sort(key=lambda r: r.time_created_ns)
        return records[-self.capacity:]

    def started(self, rec: Record) -> None:
        rec.state = "started"
        rec.time_started_ns = _now_ns()
        status = self._pg_status.get(rec.pg_id)
        if status is not None and rec.seq > status[1]:
            status[1] = rec.seq

    def ended(self, rec: Record, error: BaseException | None = None) -> None:
        rec.time_completed_ns = _now_ns()
        rec.waiting_for = rec.waiting_op = None
        if error is None:
            rec.state = "completed"
            status = self._pg_status.get(rec.pg_id)
            if status is not None and rec.seq > status[2]:
                status[2] = rec.seq
        else:
            rec.state = "failed"
            rec.error = str(error)

    def find(self, pg_id: int, seq: int) -> Record | None:
        """The newest record of group ``pg_id``'s collective ``seq``, if the
        ring still holds it (for error messages: a scan of the ring)."""
        with self._lock:
            records = self._all_records()
        for rec in reversed(records):
            if rec.pg_id == pg_id and rec.seq == seq:
                return rec
        return None

    def waiting(self, rank: int) -> list[str]:
        """What global ``rank``'s collectives in progress are waiting for, newest first."""
        with self._lock:
            records = self._all_records()
        return [text for rec in reversed(records) if rec.rank == rank and rec.state == "started"
                for text in (rec.describe_wait(),) if text]

    def in_progress(self, since_ns: int = 0) -> list[str]:
        """One line per collective created from ``since_ns`` on (a ``time.time_ns()``)
        and not finished, every rank and group: what it waits for, or its state.
        What a test that ran out of time prints, so a hang names its ranks."""
        with self._lock:
            records = [r for r in self._records
                       if r.time_created_ns >= since_ns and r.state in ("scheduled", "started")]
            names = {k: v["name"] for k, v in self._pg_config.items()}
        return [f"rank {r.rank} of group {names.get(r.pg_id, r.pg_id)!r}: "
                f"{r.describe_wait() or f'{r.call.name} (collective #{r.seq}) {r.state}'}"
                for r in records]

    def history(self, since_ns: int = 0) -> list[str]:
        """One line per collective created from ``since_ns`` on, finished or
        not, every rank and group, oldest first: when it started and ended
        (seconds after ``since_ns``), and what it waits for or why it failed.
        What a test that failed on a deadline prints: a rank whose call
        *completed* while a peer timed out waiting for it lost a message; one
        still waiting says for whom."""
        with self._lock:
            records = [r for r in self._all_records() if r.time_created_ns >= since_ns]
            names = {k: v["name"] for k, v in self._pg_config.items()}

        def at(ns):
            return "-" if ns is None else f"+{(ns - since_ns) / 1e9:.3f}s"

        lines = []
        for r in records:
            what = r.describe_wait() or f"{r.call.name} (collective #{r.seq})"
            tail = f": {r.error}" if r.error else ""
            lines.append(f"rank {r.rank} of group {names.get(r.pg_id, r.pg_id)!r}: {what} "
                         f"{r.state} (started {at(r.time_started_ns)}, ended "
                         f"{at(r.time_completed_ns)}){tail}")
        return lines

    def dump(self, rank: int | None = None) -> dict:
        """The records (of one global ``rank`` only, if given) as plain data."""
        with self._lock:
            records = self._all_records()
            config = {str(k): dict(v) for k, v in self._pg_config.items()}
            progress = {k: list(v) for k, v in self._pg_status.items()}
        for rec in records:  # the lanes' calls count too (the ring's are counted already)
            now = progress.get(rec.pg_id)
            if rec.record_id < 0 and now is not None and rec.seq > 0:
                now[0] = max(now[0], rec.seq)
                now[1] = max(now[1], rec.seq)
                if rec.state == "completed":
                    now[2] = max(now[2], rec.seq)
        status = {str(k): {"last_enqueued_collective": v[0],
                           "last_started_collective": v[1],
                           "last_completed_collective": v[2]}
                  for k, v in progress.items()}
        first_id = next((r.record_id for r in records if r.record_id >= 0), 0)
        entries = []
        for i, r in enumerate(records):
            if rank is None or r.rank == rank:
                entry = r.as_dict()
                entry["record_id"] = first_id + i  # lanes' records interleaved in time order
                entries.append(entry)
        return {"version": VERSION, "pid": os.getpid(), "rank": rank, "pg_config": config,
                "pg_status": status, "entries": entries}

    def dump_to_dir(self, directory: str, rank: int) -> str:
        """Write this rank's records to ``directory`` (see the module docstring);
        returns the file's path."""
        name = f"numcoll_fr_rank{rank}.json"
        write_private(directory, name, json.dumps(self.dump(rank)).encode())
        return os.path.join(directory, name)


def dump_on_failure(recorder: FlightRecorder | None, rank: int) -> None:
    """``recorder``'s records to ``NUMCOLL_FR_DUMP_DIR``, where that is set (a
    group's first failure); never raises: a diagnostic must not mask the failure."""
    directory = config.get("fr_dump_dir")
    if directory and recorder is not None:
        try:
            recorder.dump_to_dir(directory, rank)
        except OSError:
            pass


def write_private(directory: str, name: str, data: bytes) -> None:
    """Put ``data`` in ``directory/name`` as a new file only this user can read.

    The directory is made (0700) if missing and opened without following a
    link in its last component; the bytes go to a new file of a random name
    (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600), which is then renamed over
    ``name``: a link or file planted under either name is never written
    through, and a reader sees the old file or the whole new one. Raises
    ``OSError`` (e.g. when another user's file holds ``name`` in a sticky
    directory: it is not ours to replace)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


_recorder: FlightRecorder | None = None
_recorder_lock = threading.Lock()


def recorder() -> FlightRecorder | None:
    """The process's recorder (made on first use; None when turned off)."""
    global _recorder
    if _recorder is None:
        with _recorder_lock:
            if _recorder is None:
                size = config.get("fr_buffer_size")
                _recorder = FlightRecorder(size) if size > 0 else _OFF
    return None if _recorder is _OFF else _recorder


_OFF = FlightRecorder(0)


def enabled() -> bool:
    return recorder() is not None


def dump(rank: int | None = None) -> dict:
    """This process's records: ``{"version", "pg_config", "pg_status", "entries"}``.

    Each entry has record_id, pg_id, rank (global), collective_seq_id,
    profiling_name ("numcoll:all_reduce", torch's name of the call), input_sizes, input_dtypes,
    output_sizes, output_dtypes, state (scheduled / started / completed /
    failed), time_created_ns, time_started_ns, time_completed_ns, timeout_ms,
    algorithm, waiting_for (the peer rank a started collective is blocked on,
    or None), nbytes, root, op and error. ``rank`` keeps one rank's entries
    (ranks that are threads share a process, and so a recorder).
    """
    rec = recorder()
    if rec is None:
        return {"version": VERSION, "pid": os.getpid(), "rank": rank, "pg_config": {},
                "pg_status": {}, "entries": []}
    return rec.dump(rank)


def dump_json(rank: int | None = None) -> str:
    """:func:`dump` as a JSON string."""
    return json.dumps(dump(rank))


def _reset_for_tests(capacity: int | None = None) -> None:
    """Forget every record (and re-read the size unless ``capacity`` is given)."""
    global _recorder
    with _recorder_lock:
        _recorder = None if capacity is None else (FlightRecorder(capacity) if capacity else _OFF)
