"""Rank registrations and the http_sd view of them.

Agents register on start and deregister on close, over the daemon's agent socket
(``agent_socket``), which tells the daemon the caller's PID. A registration is accepted only
when that PID is the rank's own, its host is this node, and no other live process holds the same
(run, rank); only the owner of an entry (or nobody, once it died) may remove it. A rank that dies
without deregistering (SIGKILL, segfault) is dropped the next time /sd is served: each entry's
PID must still be alive with the start time recorded at registration, so a reused PID does not
keep a dead rank listed.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable
from typing import Any

import psutil

from ..agent_socket import Peer
from .processes import process_start_time, same_process
from .store import Store


class RegistrationRefused(Exception):
    """A registration or removal the daemon will not do; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def node_addresses() -> frozenset[str]:
    """This node's interface addresses, as ``ipaddress`` spells them (read at each call:
    interfaces come and go)."""
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            try:
                out.add(str(ipaddress.ip_address(addr.address.split("%")[0])))
            except ValueError:
                continue  # a MAC address (AF_PACKET)
    return frozenset(out)


def on_this_node(host: str, names: frozenset[str], addresses: frozenset[str]) -> bool:
    """Is ``host`` a name or an address of this node? Names count only as configured (this
    host's name, the node label, ``--allowed-host``): resolving one would let DNS decide."""
    host = host.strip().lower().rstrip(".")
    if host in names:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    addr = mapped if mapped is not None else addr
    return addr.is_loopback or str(addr) in addresses


def listens_on(pid: int, port: int) -> bool | None:
    """Does ``pid`` hold a listening TCP socket on ``port``? None when this daemon may not look
    (another user's process and no root)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


class RankRegistry:
    def __init__(
        self,
        store: Store,
        names: frozenset[str] = frozenset(),
        addresses: Callable[[], frozenset[str]] = node_addresses,
    ) -> None:
        self.store = store
        self.names = names
        """Host names that are this node (``hostcheck.host_names``)."""
        self.addresses = addresses
        self._lock = threading.Lock()  # check-then-write of one (run, rank) is atomic

    def register(self, info: dict[str, Any], peer: Peer | None) -> dict[str, Any]:
        """Record ``info`` (validated by the API) for the calling process ``peer``; raises
        RegistrationRefused with the reason otherwise."""
        if peer is None:
            raise RegistrationRefused(403, "ranks register through the daemon's agent socket")
        pid = int(info.get("pid") or peer.pid)
        if pid != peer.pid:
            raise RegistrationRefused(
                403, f"pid {pid} is not the caller's own (the caller is pid {peer.pid})"
            )
        started = process_start_time(pid)
        if started is None:
            raise RegistrationRefused(400, f"pid {pid} is not a running process on this node")
        host = str(info.get("host") or "127.0.0.1")
        if not on_this_node(host, self.names, self.addresses()):
            raise RegistrationRefused(
                400, f"host {host!r} is not an address or a name of this node"
            )
        port = int(info["port"])
        if listens_on(pid, port) is False:
            raise RegistrationRefused(400, f"pid {pid} does not listen on port {port}")
        run, rank = str(info["run"]), int(info["rank"])
        doc = {**info, "pid": pid, "host": host, "pid_create_time": started, "uid": peer.uid}
        with self._lock:
            held = self._live_holder(run, rank)
            if held is not None and held != pid:
                raise RegistrationRefused(
                    409, f"rank {rank} of run {run!r} is registered by live pid {held}"
                )
            self.store.put_rank(run, rank, doc)
        return doc

    def deregister(self, run: str, rank: int, peer: Peer | None) -> bool:
        """Remove (run, rank) for its owner; False when it is not registered."""
        if peer is None:
            raise RegistrationRefused(403, "ranks deregister through the daemon's agent socket")
        with self._lock:
            held = self._live_holder(run, rank)
            if held is not None and held != peer.pid:
                raise RegistrationRefused(
                    403, f"rank {rank} of run {run!r} belongs to live pid {held}"
                )
            return self.store.delete_rank(run, rank)

    def _live_holder(self, run: str, rank: int) -> int | None:
        """The PID of the live process registered as (run, rank), if any."""
        doc = self.store.get_rank(run, rank)
        if doc is not None and same_process(doc.get("pid"), doc.get("pid_create_time")):
            return int(doc["pid"])
        return None

    def live(self) -> list[dict[str, Any]]:
        """Registrations whose process is alive; dead ones are removed on the way."""
        alive = []
        for doc in self.store.iter_ranks():
            if same_process(doc.get("pid"), doc.get("pid_create_time")):
                alive.append(doc)
            else:
                self.store.delete_rank(str(doc["run"]), int(doc["rank"]))
        return alive

    def http_sd(self) -> list[dict[str, Any]]:
        """Prometheus ``http_sd_configs`` groups: one target per live rank.

        The job id goes into ``job_id`` (``job`` is Prometheus's scrape-job label).
        """
        groups = []
        for doc in self.live():
            labels = {
                "run": str(doc["run"]),
                "rank": str(doc["rank"]),
                "local_rank": str(doc.get("local_rank", "")),
                "node": str(doc.get("node", "")),
            }
            for key in ("job_id", "slurm_job", "slurm_user", "slurm_partition"):
                if doc.get(key):
                    labels[key] = str(doc[key])
            host = str(doc["host"])
            host = f"[{host}]" if ":" in host else host
            groups.append({"targets": [f"{host}:{doc['port']}"], "labels": labels})
        return groups
