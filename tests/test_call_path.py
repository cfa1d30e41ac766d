"""How a call flows through the code: few files, one way down.

A warm 8-byte ``nc.all_reduce`` on 2 thread ranks is followed with a profile
hook on the calling thread: which source files its functions are in, and
every call from a function in one file to a function in another (a "move").
The layers are ranked from the module API down to the transports; a call
from a lower layer back up to a higher one would be a call that goes down
and back up (a mixin reading its group's privates, a transport calling
back into a buffer), which the layout exists to prevent.
"""

import os
import sys

import numpy as np
import pytest

import numcoll as nc

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(nc.__file__)))
MAX_FILES = 14
#: 25 while requests (``PendingRequest``) lived in transports/endpoint.py; moved below
#: the mailbox into transports/pending.py (so endpoint and mailbox no longer import each
#: other), the same calls cross three more file boundaries.
MAX_MOVES = 28

#: Layers from the top (0) down; a file's layer is that of the longest prefix.
LAYERS = {
    "numcoll/api/": 0,
    "numcoll/process_group.py": 1, "numcoll/work.py": 1, "numcoll/futures.py": 1,
    "numcoll/fast/": 1,
    "numcoll/collectives/": 2,
    "numcoll/algorithms/": 3,
    "numcoll/comm.py": 4, "numcoll/call.py": 4,
    "numcoll/memory/": 5, "numcoll/kernels/": 5, "numcoll/cuda/": 5,
    "numcoll/diagnostics/": 5, "numcoll/dtypes.py": 5, "numcoll/ops.py": 5,
    "transports/": 6,
}


def layer(path: str) -> int:
    best = max((p for p in LAYERS if path.startswith(p)), key=len, default=None)
    assert best is not None, f"{path} is in no layer: add it to LAYERS"
    return LAYERS[best]


def _ours(filename: str) -> str | None:
    """``filename`` relative to the checkout if it is numcoll's or transports'."""
    rel = os.path.relpath(filename, ROOT)
    return rel if rel.startswith(("numcoll" + os.sep, "transports" + os.sep)) else None


def follow(fn):
    """Run ``fn`` under a profile hook: the files entered, in order, and the
    moves (caller file, callee file) between files of the package."""
    files, moves = [], []

    def hook(frame, event, arg):
        if event != "call":
            return
        callee = _ours(frame.f_code.co_filename)
        if callee is None:
            return
        if callee not in files:
            files.append(callee)
        caller = _ours(frame.f_back.f_code.co_filename) if frame.f_back else None
        if caller is not None and caller != callee:
            moves.append((caller, callee))

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files, moves


def test_a_warm_small_all_reduce_reads_in_few_files_and_flows_down():
    def body():
        x = np.ones(2, np.float32)
        for _ in range(5):  # warm: plans made, kernels compiled
            nc.all_reduce(x)
        if nc.get_rank() == 0:
            traced = follow(lambda: nc.all_reduce(x))
        else:
            traced = None
            nc.all_reduce(x)
        return traced

    files, moves = nc.launch(body, 2, mode="thread", timeout=50)[0]
    listing = "\n".join(f"  {a} -> {b}" for a, b in moves)
    assert len(files) <= MAX_FILES, f"{len(files)} files: {files}"
    assert len(moves) <= MAX_MOVES, f"{len(moves)} moves:\n{listing}"
    upward = [(a, b) for a, b in moves if layer(b) < layer(a)]
    assert not upward, f"calls back up a layer: {upward}\n{listing}"
