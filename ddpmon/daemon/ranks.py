"""Rank registrations and the http_sd view of them.

Agents register on start and deregister on close, over the daemon's agent socket
(``agent_socket``), which tells the daemon the caller's PID. A registration is accepted only
when that PID is the rank's own, its host is this node, and no other live process holds the same
(run, rank); only the owner of an entry (or nobody, once it died) may remove it. A rank that dies
without deregistering (SIGKILL, segfault) is dropped the next time /sd is served: each entry's
PID must still be alive with the start time recorded at registration, so a reused PID does not
keep a dead rank listed.

A run id that names one of the daemon's jobs is the job's own (discovery squatting): only the
job's processes register it (descendants of its launcher, or of its ``slurmstepd`` under
``--backend slurm``), for a rank below its ``nproc``, on one of the ports the daemon allocated
it, while it runs. Anyone else is refused (403) and the attempt is logged; an entry that another
process made before the job existed is not served under the job's labels, and the job's own rank
replaces it. Every refusal is logged with what the caller tried.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from typing import Any

import psutil

from ..web.agent_socket import Peer
from .processes import descends_from, in_slurm_job, process_start_time, same_process
from .store import JobRecord, Store

log = logging.getLogger("ddpmon.daemon.ranks")


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
        """Host names that are this node (``ddpmon.web.hostcheck.host_names``)."""
        self.addresses = addresses
        self._lock = threading.Lock()  # check-then-write of one (run, rank) is atomic

    def register(self, info: dict[str, Any], peer: Peer | None) -> dict[str, Any]:
        """Record ``info`` (validated by the API) for the calling process ``peer``; raises
        RegistrationRefused with the reason otherwise (and logs what was tried)."""
        try:
            return self._register(info, peer)
        except RegistrationRefused as exc:
            log.warning(
                "refused rank registration (%d): pid %s claimed rank %r of run %r on %r "
                "port %r: %s", exc.status, peer.pid if peer else "(TCP)", info.get("rank"),
                info.get("run"), info.get("host"), info.get("port"), exc,
            )
            raise

    def _register(self, info: dict[str, Any], peer: Peer | None) -> dict[str, Any]:
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
        job = self._job_named(run, info.get("job_id"))
        if job is not None:
            self._check_job_member(job, pid, port, rank)
            doc["job_verified"] = job.id
        with self._lock:
            held = self._live_holder(run, rank)
            if held is not None and held != pid:
                prior = self.store.get_rank(run, rank) or {}
                if job is None or prior.get("job_verified") == job.id:
                    raise RegistrationRefused(
                        409, f"rank {rank} of run {run!r} is registered by live pid {held}"
                    )
                log.warning("job %r: its rank %d (pid %d) replaces the entry of pid %d, "
                            "which is not the job's", job.id, rank, pid, held)
            self.store.put_rank(run, rank, doc)
        return doc

    def _job_named(self, run: str, job_id: Any) -> JobRecord | None:
        """The daemon job that owns this run id (or the ``job_id`` the caller names), if any."""
        for name in dict.fromkeys((run, job_id)):
            if isinstance(name, str) and name:
                job = self.store.get_job(name)
                if job is not None:
                    return job
        return None

    @staticmethod
    def _check_job_member(job: JobRecord, pid: int, port: int, rank: int) -> None:
        """Refuse (403) unless ``pid`` is one of ``job``'s own processes, serving a rank it has
        on a port the daemon allocated to it."""
        def refuse(why: str) -> None:
            raise RegistrationRefused(403, f"run {job.id!r} is a job of this daemon: {why}")

        if job.state != "RUNNING":
            refuse(f"it is {job.state}, so no process of it may register")
        if job.slurm_job_id:
            if not in_slurm_job(pid, job.slurm_job_id):
                refuse(f"pid {pid} does not run under Slurm job {job.slurm_job_id}")
        elif job.pid is None or not descends_from(pid, job.pid, job.pid_create_time):
            refuse(f"pid {pid} is not a process of the job (launcher pid {job.pid})")
        if port not in job.ports:
            refuse(f"port {port} is not one of the job's ports {job.ports}")
        if not 0 <= rank < job.nproc:
            refuse(f"rank {rank}: the job has {job.nproc} rank(s)")

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
            job = self._job_named(str(doc["run"]), doc.get("job_id"))
            if job is not None and doc.get("job_verified") != job.id:
                continue  # made before the job existed, by a process that is not the job's
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
