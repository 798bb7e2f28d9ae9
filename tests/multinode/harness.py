"""The two-node stack: a ``ddpmon daemon`` per node (TLS + basic auth on the node's address),
Prometheus and Alertmanager in the root namespace discovering ranks through each daemon's /sd
(``http_sd_configs``), and ``torchrun --nnodes 2 --nproc-per-node 2`` with c10d rendezvous.

Shared storage: both nodes' ranks write to one run directory (``run_dir/<run_id>``), as they
would on a shared file system (NFS, Lustre); ``ddpmon timeline`` reads it directly. Without
shared storage, copy every node's ``run_dir/<run_id>/`` into one directory first (the file
names carry the rank, so the copies never collide), e.g. ``rsync -a node-b:RUN_DIR/RUN/ RUN/``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from pki import PASSWORD, USER, write_web_config

from ddpmon.mixin import render
from ddpmon.mixin.config import MixinConfig
from ddpmon.services import Alertmanager, Prometheus
from tests.support.netns import Cluster, Node
from tests.support.stack import WebhookReceiver

REPO = Path(__file__).resolve().parents[2]
DAEMON_PORT = 7469
AGENT_PORT = 7470
# `for:` durations shortened for the test (shipped: 2m); everything else as shipped.
CONFIG = MixinConfig().replace(ranks_missing_for="2s", rank_down_for="2s")


@dataclass
class Stack:
    cluster: Cluster
    workdir: Path
    prometheus: Prometheus
    alertmanager: Alertmanager
    hook: WebhookReceiver
    run_dir: Path
    ca: Path
    jobs: list[Job] = field(default_factory=list)

    @property
    def node_a(self) -> Node:
        return self.cluster.nodes[0]

    @property
    def node_b(self) -> Node:
        return self.cluster.nodes[1]

    def close(self) -> None:
        for job in self.jobs:
            job.kill()
        for closer in (self.prometheus.stop, self.alertmanager.stop):
            try:
                closer()
            except Exception:  # noqa: BLE001 - teardown continues
                pass
        self.hook.__exit__(None, None, None)


@dataclass
class Job:
    run_id: str
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    started_at: float

    def node_procs(self, name: str) -> list[psutil.Process]:
        """torchrun of node ``name`` and everything under it (its ranks)."""
        try:
            top = psutil.Process(self.procs[name].pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, name: str | None = None) -> None:
        """The node dies at once: every process of it is stopped (SIGSTOP, torchrun first),
        then SIGKILLed. Killed one by one, a loaded machine could let torchrun see its first
        rank die and SIGTERM the others before their own SIGKILL came."""
        for node in [name] if name else list(self.procs):
            procs = self.node_procs(node)
            for action in ("suspend", "kill"):
                for proc in procs:  # the agent first, then its ranks
                    try:
                        getattr(proc, action)()
                    except psutil.NoSuchProcess:
                        pass

    def stop(self, names: list[str] | None = None, timeout: float = 60.0) -> None:
        """SIGTERM to torchrun (it forwards it to its ranks), then wait for every process of
        the node, ranks included, to be gone: their exit handlers write the last files."""
        procs = [p for n in names or list(self.procs) for p in self.node_procs(n)]
        for n in names or list(self.procs):
            self.procs[n].terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for n in names or list(self.procs):
            self.procs[n].wait(timeout=10)

    def wait(self, timeout: float) -> dict[str, int | None]:
        end = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: proc.poll() for name, proc in self.procs.items()}

    def until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """``predicate()`` until truthy; fails at once (with the logs) if a torchrun exits."""
        end = time.monotonic() + timeout
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except (OSError, KeyError, ValueError):
                pass  # Prometheus still starting, a series not there yet
            exited = {n: p.poll() for n, p in self.procs.items() if p.poll() is not None}
            if exited or time.monotonic() > end:
                raise AssertionError(f"{what}: not reached (exited: {exited})\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {name} ---\n{path.read_text(errors='replace')[-chars:]}"
            for name, path in self.logs.items()
        )


def start_stack(cluster: Cluster, workdir: Path) -> Stack:
    web, ca = write_web_config(workdir / "tls", [n.addr for n in cluster.nodes])
    for node in cluster.nodes:
        state = workdir / node.name / "state"
        state.mkdir(parents=True, mode=0o700)
        node.popen(
            [sys.executable, "-m", "ddpmon.cli", "daemon", "--bind", node.addr, "--port",
             str(DAEMON_PORT), "--state-dir", str(state), "--node", node.name,
             "--web-config", str(web)],
            workdir / f"daemon-{node.name}.log", cwd=REPO,
        )
    for node in cluster.nodes:
        _wait_port(node.addr, DAEMON_PORT, workdir / f"daemon-{node.name}.log")
    hook = WebhookReceiver().__enter__()
    am = Alertmanager(workdir / "alertmanager", webhook_url=hook.url, group_wait="0s",
                      group_interval="1s", repeat_interval="1h")
    rule_files = render.write(workdir / "rules", CONFIG)
    prom = Prometheus(workdir / "prometheus", sd_dir=workdir / "unused-sd", rule_files=rule_files,
                      alertmanager=am.address, scrape_interval="1s", evaluation_interval="1s")
    auth = {"basic_auth": {"username": USER, "password": PASSWORD},
            "tls_config": {"ca_file": str(ca)}}
    for job in prom.config["scrape_configs"]:
        if job["job_name"] == "ddpmon":
            job.pop("file_sd_configs", None)
            job["http_sd_configs"] = [
                {"url": f"https://{n.addr}:{DAEMON_PORT}/sd", "refresh_interval": "1s", **auth}
                for n in cluster.nodes
            ]
    prom.config["scrape_configs"].append({
        "job_name": "ddpmon-node", "scheme": "https", **auth,
        "static_configs": [{"targets": [f"{n.addr}:{DAEMON_PORT}" for n in cluster.nodes]}],
    })
    stack = Stack(cluster, workdir, prom, am, hook, workdir / "shared" / "runs", ca)
    try:
        am.start()
        prom.start()
    except BaseException:
        stack.close()
        raise
    return stack


def _wait_port(host: str, port: int, log: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on {host}:{port}: {log.read_text()[-3000:]}")


def launch(stack: Stack, run_id: str, rdzv_port: int, train_args: list[str]) -> Job:
    """``torchrun --nnodes 2 --nproc-per-node 2`` on both nodes, c10d rendezvous on node A."""
    procs, logs = {}, {}
    a = stack.node_a
    for node in stack.cluster.nodes:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{a.addr}:{rdzv_port}", "--rdzv-id", run_id,
            "--local-addr", node.addr, "--max-restarts", "0", "--monitor-interval", "0.2",
            "-m", "ddpmon.demo.train", "--run-dir", str(stack.run_dir), "--run-id", run_id,
            *train_args,
        ]
        env = {
            "GLOO_SOCKET_IFNAME": "eth0",  # the node's veth; its host name resolves nowhere
            "DDPMON_BIND": node.addr,
            "DDPMON_PORT": str(AGENT_PORT),
            # the node's daemon's agent socket (its state dir is on the shared filesystem)
            "DDPMON_DAEMON_URL": f"unix:{stack.workdir / node.name / 'state' / 'agent.sock'}",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "DDPMON_GOODPUT_SECONDS": "2",  # rank 0's goodput within the short runs' spans
            "DDPMON_PEAK_FLOPS": "1e12",  # a CPU has no peak in the table: MFU needs one
        }
        logs[node.name] = stack.workdir / f"{run_id}-{node.name}.log"
        procs[node.name] = node.popen(argv, logs[node.name], env=env, cwd=REPO)
        if node is a:
            time.sleep(0.5)  # the rendezvous host first; ranks follow host-name order anyway
    job = Job(run_id, procs, logs, time.time())
    stack.jobs.append(job)
    return job


def timeline(run_path: Path) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "timeline", str(run_path), "--json"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        msg = f"ddpmon timeline exited {res.returncode}: {res.stderr[-3000:]}"
        raise AssertionError(msg) from None
