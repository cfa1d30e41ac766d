"""What the launcher that started this process says: rank, world size, master
address — and which local address peers on other hosts can reach.

``init_process_group()`` without an init method reads, in this order (the
order of torch's ``env://`` and of accelerate's environment detection, so a
variable set explicitly always wins over one a scheduler exported):

1. torchrun / ``numcoll run``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``;
2. MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
   ``MPI_LOCALNRANKS``;
3. Open MPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``;
4. MVAPICH2: ``MV2_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_SIZE`` ...;
5. SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NTASKS_PER_NODE``.

MPI comes before SLURM because ``mpirun`` inside an ``salloc``/``sbatch``
allocation inherits the batch step's ``SLURM_PROCID=0`` on every rank.

``MASTER_ADDR`` defaults to the first host of ``SLURM_JOB_NODELIST`` under
SLURM, and to 127.0.0.1 when an MPI launcher says every rank is on this host;
``MASTER_PORT`` defaults to 29500 (torchrun's), or under SLURM to
15000 + ``SLURM_JOB_ID`` mod 10000, so that two jobs sharing a node differ.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket

__all__ = ["LaunchEnvironment", "detect_environment", "master_address", "local_host_for",
           "first_slurm_host", "KNOWN"]

DEFAULT_MASTER_PORT = 29500
_SLURM_PORT_BASE = 15000

# (source, rank, world size, local rank, local world size), in order of precedence.
_SOURCES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
KNOWN = ", ".join(f"{s[0]} ({s[1]}/{s[2]})" for s in _SOURCES)


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """What one launcher's variables say about this process."""

    source: str                 # "torchrun", "mpich", "openmpi", "mvapich", "slurm"
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None


def _int(environ, name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    # SLURM_NTASKS_PER_NODE may read "4(x2)" on heterogeneous allocations.
    match = re.match(r"\s*(-?\d+)", raw)
    if match is None:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer")
    return int(match.group(1))


def detect_environment(environ=None) -> LaunchEnvironment | None:
    """The first launcher (in the module's order) whose rank and world size are set."""
    environ = os.environ if environ is None else environ
    for source, rank, size, local_rank, local_size in _SOURCES:
        r, n = _int(environ, rank), _int(environ, size)
        if r is None or n is None:
            continue
        return LaunchEnvironment(source, r, n, _int(environ, local_rank),
                                 _int(environ, local_size))
    return None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``"node[07-09,12],gpu1"`` -> ``"node07"``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()

    def first_of(match: re.Match) -> str:
        return re.split(r"[,-]", match.group(1))[0]

    return re.sub(r"\[([^\]]*)\]", first_of, first)


def master_address(found: LaunchEnvironment | None, environ=None) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)``, defaulted from the launcher's variables.

    Raises
    ------
    ValueError
        When MASTER_ADDR is not set and cannot be derived.
    """
    environ = os.environ if environ is None else environ
    host = environ.get("MASTER_ADDR")
    if not host and found is not None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if found.source == "slurm" and nodelist:
            host = first_slurm_host(nodelist)
        elif found.local_world_size is not None and found.local_world_size == found.world_size:
            host = "127.0.0.1"   # the launcher says every rank is on this host
    if not host:
        raise ValueError("env:// rendezvous: environment variable MASTER_ADDR expected, but "
                         "not set (set it to the address of the host of rank 0)")
    raw_port = environ.get("MASTER_PORT")
    if raw_port:
        try:
            port = int(raw_port)
        except ValueError:
            raise ValueError(f"env:// rendezvous: MASTER_PORT must be an integer, got "
                             f"{raw_port!r}") from None
    elif (found is not None and found.source == "slurm"
          and environ.get("SLURM_JOB_ID", "").isdigit()):
        port = _SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % 10000
    elif found is not None and found.source != "torchrun":
        port = DEFAULT_MASTER_PORT
    else:
        raise ValueError("env:// rendezvous: environment variable MASTER_PORT expected, but "
                         "not set")
    return host, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _interface_address(names: str) -> str:
    """IPv4 address of the first interface in a comma-separated list (Linux)."""
    import fcntl
    import struct

    name = names.split(",")[0].strip()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ValueError(f"socket interface {name!r} has no IPv4 address here "
                             f"({exc.strerror}); available: "
                             f"{[n for _, n in socket.if_nameindex()]}") from None
    return socket.inet_ntoa(packed[20:24])


def local_host_for(peer_host: str | None, environ=None) -> str:
    """The local address to bind and publish so ranks on other hosts reach this one.

    ``NUMCOLL_SOCKET_IFNAME`` (or torch's ``GLOO_SOCKET_IFNAME``) names the
    interface; otherwise the address this host uses to route to ``peer_host``
    (the store's host, i.e. MASTER_ADDR). A loopback or unknown peer keeps
    127.0.0.1, so single-host groups never listen on the network.
    """
    environ = os.environ if environ is None else environ
    for variable in ("NUMCOLL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if environ.get(variable):
            return _interface_address(environ[variable])
    if not peer_host or _is_loopback(peer_host):
        return "127.0.0.1"
    try:
        peer_ip = socket.getaddrinfo(peer_host, None, socket.AF_INET)[0][4][0]
    except OSError:
        return "127.0.0.1"
    if _is_loopback(peer_ip):
        return "127.0.0.1"
    # connect() on a UDP socket sends nothing: it only asks the kernel for the route.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_ip, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
