"""numcoll's TCPStore and torch.distributed: the server speaks torch's store
protocol too (so unmodified torch scripts run under ``numcoll run``), and a
client that reaches the wrong kind of server fails at once, saying so."""

import logging
import os
import pathlib
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from numcoll.bootstrap.tcpstore import StoreAuthError, TCPStore

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SCRIPTS = pathlib.Path(__file__).parent / "torch_scripts" / "backend"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def test_torch_client_gets_torchs_answers_from_numcolls_server():
    with TCPStore(HOST, 0, is_master=True, timeout=10) as master:
        out = subprocess.run([sys.executable, str(SCRIPTS / "store_client.py"),
                              str(master.port)], env=_env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert out.stdout.strip() == "ok"
        # one key space: numcoll's clients see torch's keys (torch prefixes them with "/")
        assert master.get("/k") == b"v2" and master.get("init/") == b"1"


def test_torch_client_is_refused_where_a_token_is_required(caplog):
    caplog.set_level(logging.WARNING, logger="numcoll.bootstrap.store")
    with TCPStore(HOST, 0, is_master=True, timeout=10, token="s3cret") as master:
        client = dist.TCPStore(HOST, master.port, is_master=False,
                               timeout=timedelta(seconds=10))   # the ping is answered
        start = time.monotonic()
        with pytest.raises(Exception):   # noqa: B017 - torch's own connection error
            client.set("k", b"v")
            client.get("k")
        assert time.monotonic() - start < 5
        assert "torch.distributed client without the token" in caplog.text
        assert not master.check(["/k"])


def test_numcoll_client_names_torchs_server_at_once():
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    start = time.monotonic()
    with pytest.raises(StoreAuthError, match="is a torch.distributed TCPStore"):
        TCPStore(HOST, server.port, timeout=30)
    assert time.monotonic() - start < 2


def test_a_stranger_is_told_and_hung_up_on(caplog):
    caplog.set_level(logging.WARNING, logger="numcoll.bootstrap.store")
    with TCPStore(HOST, 0, is_master=True, timeout=10) as master:
        with socket.create_connection((HOST, master.port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        assert b"numcoll TCPStore" in answer and b"torch.distributed" in answer
        master.set("still", b"served")
        assert master.get("still") == b"served"
    assert "refused from 127.0.0.1" in caplog.text and "not a TCPStore client" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "numcoll", "cpu:numcoll,cuda:nccl"])
def test_unmodified_torch_script_under_numcoll_run(backend):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "numcoll", "run", "-n", "2",
                          str(SCRIPTS / "under_numcoll_run.py"), backend], env=_env(),
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    for rank in (0, 1):
        assert (f"[rank{rank}]: {backend} rank {rank}/2: [3.0, 3.0, 3.0] "
                f"[{{'rank': 0}}, {{'rank': 1}}]") in out.stdout, out.stdout
    assert "Ping failed" not in out.stderr
    assert time.monotonic() - start < 60
