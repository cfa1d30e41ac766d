"""``numcoll run``: start N ranks of a script on this host, torchrun-style.

::

    numcoll run -n 4 train.py --lr 0.1          # or: python -m numcoll run ...
    numcoll run -n 2 -m package.module args     # a module, like python -m
    # two hosts (run on each; node 0 hosts the store at --master-addr):
    numcoll run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -n 4 train.py
    numcoll run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -n 4 train.py

Every rank gets torchrun's environment: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``
and ``TORCHELASTIC_USE_AGENT_STORE=True`` (with ``NUMCOLL_AGENT_STORE=1``: the
store is numcoll's): as under torchrun, the launcher of node 0 serves the
TCPStore and every rank is a client of it, so ``init_process_group()`` needs
no arguments -- numcoll's, or torch.distributed's with any backend: numcoll's
TCPStore speaks torch's store protocol too (see
:mod:`numcoll.bootstrap.tcpstore.torch_wire`), so an unmodified torch script
meets in it.

Each line a rank prints is prefixed ``[rank3]: `` (stdout to stdout, stderr
to stderr). When a rank fails, the others are stopped (SIGTERM, then SIGKILL
after ``--grace``) and ``numcoll run`` exits with the first failure's code (a
rank killed by signal S counts as 128 + S). Ctrl-C (or SIGTERM) is passed on
to every rank, with the same grace. Each rank runs in a process group of its
own that is killed at the end, and dies with the launcher even if the
launcher is SIGKILLed (Linux parent-death signal), so nothing outlives a run.

With ``--keep-going``, a rank that fails is reported and the others keep
running (they can continue without it: ``nc.shrink_group()``); the run ends
when every rank has, with code 0 if some rank finished with 0 and no rank
exited with a code of its own (ranks killed by a signal are the failures
the survivors carried on from), else the first failure's code. The store
is served by this launcher, so it outlives any rank.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from ..logs import get_logger
from .parent import preexec_for

__all__ = ["main", "build_parser"]

_log = get_logger("run")
_POLL_S = 0.05


def build_parser() -> argparse.ArgumentParser:
    """The ``numcoll run`` command line (torchrun's option names)."""
    p = argparse.ArgumentParser(
        prog="numcoll run",
        description="Start ranks of a Python script (torchrun's environment contract).")
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   default=1, help="ranks on this host (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts taking part (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this host's index, 0..nnodes-1 (node 0 serves the store)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0 (default 127.0.0.1 on one host)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   default=None,
                   help="the store's port (default: a free one on one host, 29500 on many)")
    p.add_argument("--standalone", action="store_true",
                   help="one host, free port (the default when --nnodes is 1)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--keep-going", "--keep_going", dest="keep_going", action="store_true",
                   help="when a rank dies, leave the others running (they can go on "
                        "with nc.shrink_group()); the run ends when every rank has")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module (python -m)")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run the target as an executable, not with python")
    p.add_argument("target", help="the script (or module, or executable)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(argv)      # also `numcoll run -n 2 -- script.py --flag`
    if "--" in argv and ns.target in argv and argv.index(ns.target) < argv.index("--"):
        # A `--` after the script is the script's own: pass everything on verbatim.
        ns.args = argv[argv.index(ns.target) + 1:]
    if not ns.target:
        parser.error("a script to run is required")
    if ns.nproc < 1 or ns.nnodes < 1:
        parser.error("--nproc-per-node and --nnodes must be at least 1")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in 0..{ns.nnodes - 1}")
    if ns.standalone and ns.nnodes != 1:
        parser.error("--standalone runs on one host: it cannot be used with --nnodes > 1")
    if ns.nnodes > 1 and not ns.master_addr:
        parser.error("--master-addr (the address of node 0) is required with --nnodes > 1")
    if ns.module and ns.no_python:
        parser.error("--module and --no-python cannot be used together")
    return ns


class _Ranks:
    """The local rank processes, their output pumps, and stopping them."""

    def __init__(self, ns: argparse.Namespace, env: dict[str, str]):
        self.ns = ns
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.out_lock = threading.Lock()
        if ns.no_python:
            cmd = [ns.target]
        elif ns.module:
            cmd = [sys.executable, "-u", "-m", ns.target]
        else:
            cmd = [sys.executable, "-u", ns.target]
        self.cmd = cmd + list(ns.args)
        self.env = env

    def start(self) -> None:
        ns = self.ns
        world_size = ns.nnodes * ns.nproc
        preexec = preexec_for(os.getpid())
        for local_rank in range(ns.nproc):
            rank = ns.node_rank * ns.nproc + local_rank
            env = dict(self.env, RANK=str(rank), LOCAL_RANK=str(local_rank),
                       GROUP_RANK=str(ns.node_rank), ROLE_RANK=str(rank),
                       WORLD_SIZE=str(world_size), ROLE_WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(ns.nproc))
            proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=preexec)
            self.procs.append(proc)
            for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=self._pump, args=(rank, src, dst), daemon=True,
                                     name=f"numcoll-run-pump{rank}")
                t.start()
                self.pumps.append(t)
            _log.debug("started rank %d (pid %d): %s", rank, proc.pid, self.cmd)

    def _pump(self, rank: int, src, dst) -> None:
        prefix = b"" if self.ns.no_prefix else f"[rank{rank}]: ".encode()
        out = getattr(dst, "buffer", None)
        for line in iter(src.readline, b""):
            if not line.endswith(b"\n"):   # a last line without one: keep lines apart
                line += b"\n"
            with self.out_lock:
                if out is not None:
                    out.write(prefix + line)
                    out.flush()
                else:   # a text stream without a buffer (e.g. captured by pytest)
                    dst.write((prefix + line).decode(errors="replace"))
                    dst.flush()
        src.close()

    def rank_of(self, index: int) -> int:
        return self.ns.node_rank * self.ns.nproc + index

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, first_sig: int = signal.SIGTERM) -> None:
        """Signal every running rank, then SIGKILL what is left after the grace."""
        self.signal_all(first_sig)
        deadline = time.monotonic() + self.ns.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(_POLL_S)
        self.signal_all(signal.SIGKILL)

    def reap(self) -> None:
        """Wait for every rank; kill their process groups (grandchildren too)."""
        for proc in self.procs:
            try:
                proc.wait(timeout=max(self.ns.grace, 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for t in self.pumps:
            t.join(timeout=2.0)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _keep_going(ranks: _Ranks, states: list, failed: list, reported: set) -> tuple[bool, int]:
    """``--keep-going``: report each failure once; done when every rank is."""
    for i, rc in failed:
        if i not in reported:
            reported.add(i)
            how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0
                   else f"exited with code {rc}")
            print(f"numcoll run: rank {ranks.rank_of(i)} (pid {ranks.procs[i].pid}) {how}; "
                  "the other ranks keep going (--keep-going)", file=sys.stderr, flush=True)
    if any(rc is None for rc in states):
        return False, 0
    coded = [rc for rc in states if rc not in (None, 0) and rc > 0]
    if 0 in states and not coded:
        return True, 0
    return True, _exit_code(failed[0][1]) if failed else 0


def _serve_store(ns: argparse.Namespace):
    """Node 0 serves the TCPStore the ranks meet in; returns (store, addr, port)."""
    from ..bootstrap.tcpstore import TCPStore

    addr = ns.master_addr or "127.0.0.1"
    if ns.node_rank != 0:
        return None, addr, ns.master_port or 29500
    port = ns.master_port if ns.master_port is not None else (0 if ns.nnodes == 1 else 29500)
    try:
        store = TCPStore(addr, port, None, is_master=True, timeout=timedelta(days=1))
    except OSError as exc:
        raise SystemExit(f"numcoll run: cannot serve the store at {addr}:{port}: {exc} "
                         "(is the port in use, or --master-addr not an address of this "
                         "host?)") from None
    return store, addr, store.port


def main(argv: list[str] | None = None) -> int:
    """Run ``numcoll run``; returns the exit code (0, or the first failure's)."""
    ns = _parse(list(sys.argv[1:] if argv is None else argv))
    store, addr, port = _serve_store(ns)
    env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port),
               GROUP_WORLD_SIZE=str(ns.nnodes), ROLE_NAME="default",
               TORCHELASTIC_USE_AGENT_STORE="True", NUMCOLL_AGENT_STORE="1",
               TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0",
               TORCHELASTIC_RUN_ID=os.environ.get("TORCHELASTIC_RUN_ID",
                                                  f"numcoll-{secrets.token_hex(4)}"),
               PYTHONUNBUFFERED="1")
    if ns.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")   # as torchrun: N ranks share the cores
    ranks = _Ranks(ns, env)
    interrupted: list[int] = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    reported: set[int] = set()
    try:
        ranks.start()
        while True:
            if interrupted:
                sig = interrupted[0]
                print(f"numcoll run: got {signal.Signals(sig).name}; stopping every rank",
                      file=sys.stderr, flush=True)
                ranks.stop(first_sig=signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM)
                code = 128 + sig
                break
            states = [p.poll() for p in ranks.procs]
            failed = [(i, rc) for i, rc in enumerate(states) if rc not in (None, 0)]
            if ns.keep_going:
                done, code = _keep_going(ranks, states, failed, reported)
                if done:
                    break
            elif failed:
                i, rc = failed[0]
                how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0
                       else f"exited with code {rc}")
                print(f"numcoll run: rank {ranks.rank_of(i)} (pid {ranks.procs[i].pid}) {how}; "
                      "stopping the other ranks", file=sys.stderr, flush=True)
                ranks.stop()
                code = _exit_code(rc)
                break
            if all(rc == 0 for rc in states):
                _log.info("all %d local ranks exited with code 0", len(states))
                break
            time.sleep(_POLL_S)
    finally:
        if ranks.procs:
            if any(p.poll() is None for p in ranks.procs):
                ranks.stop()
            ranks.reap()
        for s, handler in old.items():
            signal.signal(s, handler)
        if store is not None:
            store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
