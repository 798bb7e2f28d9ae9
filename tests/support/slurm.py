"""A real Slurm cluster on one machine: munged, slurmctld and two slurmd "nodes" (Debian's
``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``, 22.05), each slurmd in its own network
and UTS namespace (``tests/support/netns.py``), so ``node-a`` and ``node-b`` have their own
address and host name, as two hosts would.

Everything is private to the harness: its own munge key and socket, its own ``slurm.conf``
(``SLURM_CONF``), state and spool directories, ports chosen free, a 5 s credential lifetime (so
a requeued job starts again within seconds, not two minutes). Accounting is real too: a private
MariaDB (Debian ``mariadb-server``, its own data dir and loopback port) behind ``slurmdbd``, so
``sacct`` answers as on a production cluster; ``scontrol show job`` also keeps a finished job for
``MinJobAge`` (600 s here). ``close()`` stops every daemon and every job process and removes the
namespaces, also after errors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpmon.job.slurm import ENDED
from tests.support.netns import Cluster, NetnsUnavailable, check_available, create
from tests.support.ports import free_port

COMMANDS = ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "scontrol", "squeue",
            "sinfo", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")


class SlurmUnavailable(RuntimeError):
    """The message is the skip reason."""


def check() -> None:
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing: Debian "
                               "slurmctld slurmd slurmdbd slurm-client munge mariadb-server)")
    try:
        check_available()
    except NetnsUnavailable as exc:
        raise SlurmUnavailable(str(exc)) from None


@dataclass
class SlurmCluster:
    workdir: Path
    net: Cluster
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def nodes(self):
        return self.net.nodes

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def sbatch(self, script: Path, *options: str) -> str:
        res = self.run("sbatch", "--parsable", *options, str(script))
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``, as a dict (empty once Slurm forgot the job)."""
        res = self.run("scontrol", "show", "job", "-o", job_id)
        out: dict[str, str] = {}
        for item in res.stdout.split():
            key, _, value = item.partition("=")
            out.setdefault(key, value)
        return out

    def accounted_state(self, job_id: str) -> str | None:
        """The job's state in the accounting database (``sacct``), first word only."""
        res = self.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
        rows = res.stdout.splitlines()  # "CANCELLED by 0": the first word is the state
        return rows[-1].split(" ")[0] if rows else None

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Until the controller reports one of ``states``, and where that is an end, until
        the accounting database has it too (it learns of an end a moment later)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in states and (state not in ENDED
                                    or self.accounted_state(job_id) == state):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not {states} after {timeout}s: {info}\n"
                                   + self.logs())
            time.sleep(0.5)

    def kill_node(self, name: str) -> None:
        """The node dies: SIGKILL to everything in its namespace (slurmd, the job's steps)."""
        node = next(n for n in self.nodes if n.name == name)
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def start_node(self, name: str) -> None:
        """The node comes back: its slurmd starts again (``ReturnToService=2`` takes it in)."""
        node = next(n for n in self.nodes if n.name == name)
        node.popen(["slurmd", "-D"], self.workdir / f"{node.name}.restart.out", env=self.env)

    def logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmdbd.log", "slurmd-node-a.log", "slurmd-node-b.log"):
            path = self.workdir / name
            if path.exists():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(tails)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user", "root", timeout=10)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.net.close()  # slurmd, slurmstepd and every task: killed with the namespaces


def start(workdir: Path) -> SlurmCluster:
    check()
    workdir.mkdir(parents=True, exist_ok=True)
    net = create(("node-a", "node-b"))
    cluster = SlurmCluster(workdir, net, {})
    try:
        _start(cluster)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _start(cluster: SlurmCluster) -> None:
    w, net = cluster.workdir, cluster.net
    key = w / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    sock = w / "munge.socket"
    cluster.procs.append(subprocess.Popen(
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
         f"--pid-file={w / 'munged.pid'}", f"--log-file={w / 'munged.log'}",
         f"--seed-file={w / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    (w / "state").mkdir(exist_ok=True)
    ctl_port, node_port = free_port(), free_port()
    dbd_port = _start_accounting(cluster, sock)
    # 4 CPUs a node, more than the machine has (SlurmdParameters=config_overrides): the tests'
    # jobs are light, and a long one (the time limit's) can run beside the others
    nodes = "".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs=4 State=UNKNOWN\n"
                    for n in net.nodes)
    names = ",".join(n.name for n in net.nodes)
    (w / "slurm.conf").write_text(f"""ClusterName=ddpmon
SlurmctldHost={socket.gethostname()}({net.gateway})
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=5
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool-%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={sock}
SlurmctldTimeout=30
SlurmdTimeout=10
MinJobAge=600
KillWait=5
{nodes}PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")
    # slurmd will not start without a cgroup plugin: v2 where /sys/fs/cgroup is the unified
    # tree, v1 where it holds the per-controller mounts (a hybrid tree, as on this machine)
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    (w / "cgroup.conf").write_text(
        f"CgroupPlugin=cgroup/{'v2' if unified else 'v1'}\nCgroupMountpoint=/sys/fs/cgroup\n")
    env = {**os.environ, **cluster.env}
    res = cluster.run("sacctmgr", "-i", "add", "cluster", "ddpmon")
    assert res.returncode == 0, f"sacctmgr add cluster: {res.stdout}{res.stderr}"
    cluster.procs.append(subprocess.Popen(
        ["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for node in net.nodes:
        node.popen(["slurmd", "-D"], w / f"{node.name}.out", env=cluster.env)
    deadline = time.monotonic() + 60
    while True:
        res = cluster.run("sinfo", "-h", "-N", "-o", "%N %T")
        if res.stdout.count("idle") == len(net.nodes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Slurm nodes did not come up: {res.stdout}{res.stderr}\n"
                               + cluster.logs())
        time.sleep(0.5)


def _start_accounting(cluster: SlurmCluster, munge_socket: Path) -> int:
    """A private MariaDB and the ``slurmdbd`` in front of it; returns slurmdbd's port.

    ``slurmdbd`` reads ``slurmdbd.conf`` beside ``SLURM_CONF`` and refuses one that others can
    read. The database's root account has no password and listens on loopback only.
    """
    w = cluster.workdir
    data, db_port, dbd_port = w / "mariadb", free_port(), free_port()
    res = subprocess.run(
        ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
         "--auth-root-authentication-method=normal", "--skip-test-db"],
        capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"mariadb-install-db failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    cluster.procs.append(subprocess.Popen(
        ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root", f"--port={db_port}",
         "--bind-address=127.0.0.1", f"--socket={w / 'mariadb.sock'}",
         f"--pid-file={w / 'mariadb.pid'}", f"--log-error={w / 'mariadb.log'}",
         "--innodb-buffer-pool-size=32M", "--skip-log-bin"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_listening(db_port, 60, w / "mariadb.log")
    conf = w / "slurmdbd.conf"
    conf.write_text(f"""AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
LogFile={w}/slurmdbd.log
PidFile={w}/slurmdbd.pid
""")
    conf.chmod(0o600)
    cluster.env = {"SLURM_CONF": str(w / "slurm.conf")}
    cluster.procs.append(subprocess.Popen(
        ["slurmdbd", "-D"], env={**os.environ, **cluster.env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_listening(dbd_port, 60, w / "slurmdbd.log")
    return dbd_port


def _wait_listening(port: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s:\n{tail}")
        time.sleep(0.1)
