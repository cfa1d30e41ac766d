"""init_process_group() with no arguments under torchrun, mpirun (Open MPI,
MPICH) and srun; the address peers on other hosts reach; a rendezvous that
says who it is waiting for; a port that is not a store fails fast."""

import logging
import socket
import threading
import time

import pytest

import numcoll as nc
from numcoll.bootstrap.init_methods import rendezvous
from numcoll.bootstrap.launcher_env import (
    detect_environment,
    first_slurm_host,
    local_host_for,
    master_address,
)
from numcoll.bootstrap.tcpstore import StoreConnectionError

pytestmark = pytest.mark.timeout(60)

_ALL_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
             "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID",
             "TORCHELASTIC_USE_AGENT_STORE", "NUMCOLL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_precedence_torchrun_then_mpi_then_slurm():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    pmi = {"PMI_RANK": "2", "PMI_SIZE": "4"}
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    # mpirun inside an sbatch allocation: the batch step's SLURM_PROCID=0 must not win.
    assert detect_environment({**slurm, **ompi}).source == "openmpi"
    assert detect_environment({**slurm, **ompi}).rank == 3
    assert detect_environment({**slurm, **ompi, **pmi}).source == "mpich"
    assert detect_environment({**slurm, **ompi, **pmi, **torchrun}).rank == 1
    assert detect_environment(slurm).source == "slurm"
    assert detect_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8",
                               "SLURM_NTASKS_PER_NODE": "4(x2)"}).local_world_size == 4
    assert detect_environment({}) is None


def test_master_address_defaults():
    found = detect_environment({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    env = {"SLURM_JOB_NODELIST": "gpu[017-018,20],cpu1", "SLURM_JOB_ID": "123456"}
    assert master_address(found, env) == ("gpu017", 15000 + 123456 % 10000)
    assert master_address(found, {**env, "MASTER_ADDR": "h", "MASTER_PORT": "7"}) == ("h", 7)
    one_host = detect_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert master_address(one_host, {}) == ("127.0.0.1", 29500)
    two_hosts = detect_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                    "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    with pytest.raises(ValueError, match="MASTER_ADDR expected"):
        master_address(two_hosts, {})
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("rack[2-3]-n[01-04]") == "rack2-n01"


def test_local_host_for_peers():
    assert local_host_for("127.0.0.1", {}) == "127.0.0.1"
    assert local_host_for("localhost", {}) == "127.0.0.1"
    assert local_host_for(None, {}) == "127.0.0.1"
    assert local_host_for("10.1.2.3", {"NUMCOLL_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert local_host_for("10.1.2.3", {"GLOO_SOCKET_IFNAME": "lo,eth0"}) == "127.0.0.1"
    with pytest.raises(ValueError, match="no IPv4 address"):
        local_host_for("10.1.2.3", {"NUMCOLL_SOCKET_IFNAME": "nosuchif0"})


@pytest.mark.parametrize("variables", [
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
    {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALNRANKS": "1"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "localhost"},
], ids=["openmpi", "mpich", "slurm"])
def test_init_process_group_without_arguments_under_a_launcher(clean_env, variables):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    nc.init_process_group()
    try:
        assert (nc.get_rank(), nc.get_world_size()) == (0, 1)
    finally:
        nc.destroy_process_group()


def test_rendezvous_logs_who_is_missing_and_times_out_saying_so(clean_env, caplog):
    clean_env.setenv("NUMCOLL_RENDEZVOUS_LOG_S", "0.3")
    port = _free_port()
    errors = []

    def rank(r):
        try:
            # The master's deadline passes first, as when it is the one that gives up.
            next(rendezvous(f"tcp://127.0.0.1:{port}", r, 3, timeout=2.0 if r == 0 else 4.0))
        except Exception as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    caplog.set_level(logging.WARNING, logger="numcoll")
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 10
    assert len(errors) == 2
    for exc in errors:   # the master times out; a rank that loses it says where it stood
        assert "2 of 3 ranks joined; waiting for rank 2" in str(exc)
        if isinstance(exc, nc.StoreTimeoutError):
            assert str(exc).startswith("Timed out waiting 2000ms for rendezvous")
        else:
            assert isinstance(exc, StoreConnectionError) and "lost TCPStore" in str(exc)
    assert any(isinstance(exc, nc.StoreTimeoutError) for exc in errors)
    logged = [r.getMessage() for r in caplog.records if r.name == "numcoll.rendezvous"]
    assert any("2 of 3 ranks joined; waiting for rank 2" in m for m in logged), logged


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"],
                         ids=["silent", "http"])
def test_a_port_that_is_not_a_store_fails_fast(clean_env, reply):
    clean_env.setenv("NUMCOLL_STORE_PROBE_S", "0.5")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    conns = []

    def serve():
        try:
            conn, _ = server.accept()
        except OSError:
            return
        conns.append(conn)
        if reply is not None:
            conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        with pytest.raises(StoreConnectionError, match="did not answer like a numcoll TCPStore"):
            next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=60))
        assert time.monotonic() - start < 20  # the 0.5 s probe, far from the 60 s timeout
    finally:
        server.close()
        for c in conns:
            c.close()


@pytest.mark.slow
def test_logging_level_from_the_environment(tmp_path):
    import subprocess
    import sys

    code = ("import numcoll as nc; nc.init_process_group('gloo', store=nc.HashStore(), "
            "rank=0, world_size=1); nc.destroy_process_group()")
    for env, expect in (({"NUMCOLL_LOG_LEVEL": "info"}, True), ({"NUMCOLL_DEBUG": "1"}, True),
                        ({}, False)):
        import os

        full = {k: v for k, v in os.environ.items()
                if k not in ("NUMCOLL_LOG_LEVEL", "NUMCOLL_DEBUG")}
        out = subprocess.run([sys.executable, "-c", code], env={**full, **env},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert ("default group ready: rank 0 of 1" in out.stderr) is expect, out.stderr
        if expect:
            assert "numcoll[pid" in out.stderr and "rank 0]" in out.stderr
