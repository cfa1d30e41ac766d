"""Hosts made of Linux network namespaces, for tests and cable measurements.

Each "host" is a network namespace of its own (its own interfaces, routes and
ports), and a process started on it gets a UTS namespace with the hostname
``host<i>``, so numcoll tells the hosts apart as it tells real ones (host
name and network namespace: :func:`transports.host_key`). The hosts are
joined by veth pairs ("cables": ``eth0`` on the host, ``p<i>`` on the switch)
to a bridge inside a namespace made for the purpose; addresses
10.77.0.0/24 exist only inside these namespaces and go with them.

Needs root, iproute2 and unshare (:func:`unavailable` says why not). A cable
can be pulled (:meth:`Hosts.cut`) or limited (:meth:`Hosts.limit`, a token
bucket: ``tc ... tbf``), and its byte counters read (:meth:`Hosts.counters`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

__all__ = ["Hosts", "unavailable", "SUBNET"]

SUBNET = "10.77.0"


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                          timeout=30).stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = f"ncprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return f"cannot create network namespaces here: {detail.strip() or exc}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """``n`` namespaces (hosts 0..n-1 at 10.77.0.1..) on one bridge.

    A context manager; :meth:`remove` deletes every namespace it made (the
    processes in them must have ended).
    """

    def __init__(self, n: int):
        tag = uuid.uuid4().hex[:6]
        self.switch = f"nc{tag}sw"
        self.names = [f"nc{tag}h{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.remove()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self.made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            _ip("netns", "add", name)
            self.made.append(name)
            # Both ends are created straight inside their namespaces.
            _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name",
                f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def popen(self, host: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Run ``argv`` on host ``host`` (its namespace, hostname ``host<i>``),
        in a session of its own, output piped."""
        inner = "hostname \"$0\" && exec \"$@\""
        cmd = ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c", inner,
               f"host{host}", *argv]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def counters(self, host: int) -> tuple[int, int]:
        """Bytes host ``host`` has sent and received on its cable (its
        ``eth0``'s kernel counters, as /sys/class/net/eth0/statistics)."""
        stats = json.loads(_ip("-j", "-s", "-n", self.names[host], "link", "show", "eth0"))
        stats = stats[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def limit(self, host: int, rate: str = "1gbit", burst: str = "512kb",
              latency: str = "100ms") -> None:
        """Limit host ``host``'s cable to ``rate`` both ways (a token bucket
        on each end's egress). ``subprocess.CalledProcessError`` where the
        kernel has no tbf."""
        for namespace, device in ((self.names[host], "eth0"), (self.switch, f"p{host}")):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev",
                            device, "root", "tbf", "rate", rate, "burst", burst, "latency",
                            latency], check=True, capture_output=True, timeout=30)

    def unlimit(self, host: int) -> None:
        for namespace, device in ((self.names[host], "eth0"), (self.switch, f"p{host}")):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev",
                            device, "root"], capture_output=True, timeout=30)

    def cut(self, host: int) -> None:
        """Pull host ``host``'s cable: its switch end goes down (no reset, no
        close: packets are just lost)."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def mend(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def pids(self) -> list[int]:
        """Processes still running in any host's namespace."""
        out = []
        for name in self.names:
            out += [int(p) for p in _ip("netns", "pids", name).split()]
        return out

    def remove(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
