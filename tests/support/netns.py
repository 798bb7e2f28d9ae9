"""Two "nodes" on one machine: a network namespace each, joined by a bridge, with their own
address and host name (a UTS namespace per process tree). Needs root and ``ip netns``.

Layout (S is a free third octet, chosen per harness so parallel runs do not collide)::

    root namespace: bridge ddpmbr<S> 10.231.S.1/24  (Prometheus, Alertmanager: 127.0.0.1)
      ├─ veth -> namespace ddpm<S>a: eth0 10.231.S.2/24, host name node-a
      └─ veth -> namespace ddpm<S>b: eth0 10.231.S.3/24, host name node-b

Only addresses inside 10.231.S.0/24 and loopback are used. ``Cluster.close`` kills every
process started in the namespaces and removes the namespaces and the bridge, also after errors.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.231"
ETC_NETNS = Path("/etc/netns")
"""``ip netns exec NAME`` bind-mounts ``/etc/netns/NAME/*`` over ``/etc/*``: the nodes' hosts."""


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here; the message is the skip reason."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def check_available() -> None:
    """Raise ``NetnsUnavailable`` with the reason when this process cannot make namespaces."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("two-node harness needs root (ip netns, veth, bridge)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"two-node harness needs {tool!r} (iproute2, util-linux)")
    probe = f"ddpmprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        raise NetnsUnavailable(f"ip netns is not permitted here: {res.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


@dataclass
class Node:
    name: str
    """Host name inside the node (and its ``node`` label)."""
    netns: str
    addr: str
    veth: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this node: its network namespace, a fresh UTS namespace with
        this node's host name, its own session (so its whole process group can be killed)."""
        cmd = [
            "ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.name, *argv,
        ]
        out = open(log, "wb")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                cwd=cwd, start_new_session=True,
            )
        finally:
            out.close()
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process in this node's network namespace."""
        res = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in res.stdout.split()]


@dataclass
class Cluster:
    octet: int
    bridge: str
    nodes: list[Node]

    @property
    def gateway(self) -> str:
        return f"{SUBNET}.{self.octet}.1"

    def close(self) -> None:
        for node in self.nodes:
            for proc in node.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for pid in node.pids():  # anything that left its process group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in node.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for node in self.nodes:
            shutil.rmtree(ETC_NETNS / node.netns, ignore_errors=True)
            _ip("netns", "del", node.netns, check=False)
            _ip("link", "del", node.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only if empty: other namespaces' files stay


def _free_octet() -> int:
    used = _ip("-o", "addr").stdout
    names = _ip("-o", "link").stdout + _ip("netns", "list").stdout
    for octet in random.sample(range(1, 250), 249):
        if f"{SUBNET}.{octet}." not in used and f"ddpm{octet}a" not in names:
            return octet
    raise RuntimeError(f"no free {SUBNET}.X.0/24 subnet")


def create(names: tuple[str, ...] = ("node-a", "node-b")) -> Cluster:
    """Bridge + one namespace per name; on failure everything made so far is removed."""
    octet = _free_octet()
    cluster = Cluster(octet, f"ddpmbr{octet}", [])
    try:
        _ip("link", "add", cluster.bridge, "type", "bridge")
        _ip("addr", "add", f"{cluster.gateway}/24", "dev", cluster.bridge)
        _ip("link", "set", cluster.bridge, "up")
        for i, name in enumerate(names):
            suffix = chr(ord("a") + i)
            node = Node(name, f"ddpm{octet}{suffix}", f"{SUBNET}.{octet}.{i + 2}",
                        f"ddpm{octet}{suffix}v")
            _ip("netns", "add", node.netns)
            cluster.nodes.append(node)
            _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0",
                "netns", node.netns)
            _ip("link", "set", node.veth, "master", cluster.bridge, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        # torchrun resolves its own host name (c10d rendezvous): give each node a hosts file.
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in cluster.nodes)
        for node in cluster.nodes:
            (ETC_NETNS / node.netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / node.netns / "hosts").write_text(hosts)
        _wait_reachable(cluster)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _wait_reachable(cluster: Cluster, timeout: float = 10.0) -> None:
    """Each node reaches the other and the root namespace (bridge ports take a moment)."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    end = time.monotonic() + timeout
    while True:
        ok = all(
            subprocess.run(["ip", "netns", "exec", src.netns, "ping", "-c1", "-W1", dst],
                           capture_output=True, timeout=5).returncode == 0
            for src, dst in ((a, b.addr), (b, a.addr), (a, cluster.gateway))
        ) if shutil.which("ping") else True
        if ok:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"namespaces {a.netns} and {b.netns} cannot reach each other")
        time.sleep(0.2)
