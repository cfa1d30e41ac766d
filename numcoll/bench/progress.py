"""Progress of a sweep, shown by the process that launched the ranks.

The ranks may be other processes (whose stderr a notebook never shows), so
rank 0 does not draw anything: it appends short lines to a file, and a thread
of the launching process reads them and draws a tqdm text bar (on a terminal,
and in a notebook, where it is the cell's stderr) or, when stderr is not a
terminal (a log, CI, a pipe), prints one plain line per size. In a notebook
the text bar is used rather than tqdm's widget: a saved notebook keeps a
widget's plain-text fallback as it was drawn first ("0%"), while the text
bar's last state is the saved output ("100%").

Line format (tab-separated): ``C <case> <text>`` when case number ``case``
(counted over every plan of the launch) starts, ``T <case> <fraction>`` as
its iterations go by (at most every :data:`TICK_S` seconds).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from typing import IO

__all__ = ["Reporter", "ProgressDisplay", "progress_style", "TICK_S"]

#: The least time between two fraction updates written by rank 0, in seconds.
TICK_S = 0.1
_POLL_S = 0.05


class Reporter:
    """Rank 0's end: picklable (it travels to spawned ranks), appends lines."""

    def __init__(self, path: str):
        self.path = path
        self._last = 0.0

    def _write(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def start_case(self, case: int, text: str) -> None:
        self._last = time.monotonic()
        self._write(f"C\t{case}\t{text}")

    def tick(self, case: int, fraction: float) -> None:
        now = time.monotonic()
        if now - self._last >= TICK_S:
            self._last = now
            self._write(f"T\t{case}\t{fraction:.4f}")


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = getattr(shell, "get_ipython", lambda: None)() if shell else None
    return ip is not None and getattr(ip, "kernel", None) is not None


def progress_style(requested: str | bool = "auto", stream: IO | None = None) -> str:
    """``"bar"``, ``"lines"`` or ``"none"`` for ``requested`` ("auto", True,
    False or one of those): auto and True give a bar in a notebook or on a
    terminal (when tqdm is installed), plain lines otherwise."""
    if requested is False or requested == "none":
        return "none"
    if requested in ("bar", "lines"):
        return requested
    if requested not in ("auto", True):
        raise ValueError(f"progress must be 'auto', 'bar', 'lines', 'none' or a bool, "
                         f"got {requested!r}")
    stream = sys.stderr if stream is None else stream
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return "lines"
    isatty = getattr(stream, "isatty", lambda: False)
    return "bar" if _in_notebook() or isatty() else "lines"


def _make_bar(total: int, stream: IO):
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} sizes [{elapsed}<{remaining}]"
    from tqdm import tqdm

    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    # A terminal that reports no size (a bare pseudo-terminal) gets 80x24:
    # tqdm would draw nothing on a screen of 0 columns and 0 lines.
    sized = size.columns > 0 and size.lines > 0
    return tqdm(total=total, file=stream, bar_format=fmt, dynamic_ncols=sized,
                ncols=None if sized else 80, nrows=None if sized else 24)


class ProgressDisplay:
    """``with ProgressDisplay(total, style) as reporter:`` launch the ranks,
    giving ``reporter`` (None when nothing is shown) to rank 0.

    ``total`` is the number of cases (sizes) over all the plans of the launch.
    """

    def __init__(self, total: int, style: str = "auto", stream: IO | None = None):
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.style = progress_style(style, self.stream)
        self._stop = threading.Event()
        self._bar = None
        self._pending = ""
        self._offset = 0
        self._path = None
        self._thread = None

    def __enter__(self) -> Reporter | None:
        if self.style == "none":
            return None
        fd, self._path = tempfile.mkstemp(prefix="numcoll-bench-progress-", suffix=".txt")
        os.close(fd)
        if self.style == "bar":
            self._bar = _make_bar(self.total, self.stream)
        self._thread = threading.Thread(target=self._follow, name="numcoll-bench-progress",
                                        daemon=True)
        self._thread.start()
        return Reporter(self._path)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._read()  # whatever came after the thread's last look
        if self._bar is not None:
            if exc_type is None:
                self._bar.n = self.total
            self._bar.refresh()
            self._bar.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)

    def _follow(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._read()

    def _read(self) -> None:
        try:
            with open(self._path, encoding="utf-8") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return
        text = self._pending + chunk
        lines = text.split("\n")
        self._pending = lines.pop()  # an unfinished last line waits for the next read
        for line in lines:
            self._show(line.split("\t"))

    def _show(self, fields: list[str]) -> None:
        if len(fields) != 3:
            return
        kind, case, value = fields[0], int(fields[1]), fields[2]
        if self.style == "lines":
            if kind == "C":
                print(f"{value} ({case + 1}/{self.total})", file=self.stream, flush=True)
            return
        if kind == "C":
            self._bar.set_description_str(value, refresh=False)
            self._bar.n = case
        else:
            self._bar.n = case + float(value)
        self._bar.refresh()

