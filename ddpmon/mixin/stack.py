"""A local Prometheus + Alertmanager running the shipped configuration, on loopback.

Used by ``ddpmon stack`` and by the live tests (``tests/support/stack.py``). The shipped files
(``deploy/prometheus/prometheus.yml``, ``deploy/alertmanager/alertmanager.yml``) are loaded and
only the machine-specific parts are replaced: the file_sd directory, rule file paths, listen
ports, the Alertmanager address, webhook URLs and, for tests, the intervals. Each server runs in
its own process group with a temporary data directory and is stopped with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ddpmon.mixin import render

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


class StackError(RuntimeError):
    """A server is missing, failed to start or did not become ready; the message says which."""


def find_binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
        if Path(f"/usr/bin/{name}").exists():
            return f"/usr/bin/{name}"
    raise StackError(
        f"{' or '.join(names)} not found; install Debian's prometheus and prometheus-alertmanager "
        "packages (`make debs`)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(
    *,
    sd_dir: str | Path,
    rule_files: list[str | Path],
    alertmanager: str | None,
    scrape_interval: str | None = None,
    evaluation_interval: str | None = None,
    base: Path = PROMETHEUS_YML,
) -> dict[str, Any]:
    """The shipped prometheus.yml with this machine's paths and addresses filled in."""
    cfg = yaml.safe_load(base.read_text())
    glob = str(Path(sd_dir).resolve() / "*.json")
    for job in cfg["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [glob]
            if scrape_interval:
                sd["refresh_interval"] = scrape_interval
    cfg["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    if alertmanager:
        cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    else:
        cfg.pop("alerting", None)
    glob_cfg = cfg.setdefault("global", {})
    if scrape_interval:
        glob_cfg["scrape_interval"] = scrape_interval
        glob_cfg["scrape_timeout"] = scrape_interval
    if evaluation_interval:
        glob_cfg["evaluation_interval"] = evaluation_interval
    return cfg


def alertmanager_config(
    *,
    webhook_url: str,
    group_wait: str | None = None,
    group_interval: str | None = None,
    repeat_interval: str | None = None,
    base: Path = ALERTMANAGER_YML,
) -> dict[str, Any]:
    """The shipped alertmanager.yml, every webhook pointed at ``webhook_url/<receiver>``.

    The timing overrides apply to the root route and every sub-route (tests want notifications
    within a second, not after the production ``group_wait``).
    """
    cfg = yaml.safe_load(base.read_text())
    for receiver in cfg.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url.rstrip('/')}/{receiver['name']}"
    timings = {
        "group_wait": group_wait,
        "group_interval": group_interval,
        "repeat_interval": repeat_interval,
    }

    def retime(route: dict) -> None:
        for key, value in timings.items():
            if value is not None and (key in route or route is cfg["route"]):
                route[key] = value
        for child in route.get("routes", []):
            retime(child)

    retime(cfg["route"])
    return cfg


class ManagedProcess:
    """A server in its own process group, logging to a file; ``stop()`` always reaps it."""

    def __init__(self, name: str, cmd: list[str], log_path: Path) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, url: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                raise StackError(f"{self.name} exited with {code}: {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise StackError(f"{self.name} not ready at {url} after {timeout:g}s: {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        return proc.poll()


class _Server:
    """Lifecycle shared by the Prometheus and Alertmanager wrappers (``_process`` set by start)."""

    _process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> _Server:
        raise NotImplementedError

    def poll(self) -> int | None:
        """None while the server runs (or before start); its exit code once it has exited."""
        proc = self._process.proc if self._process else None
        return proc.poll() if proc is not None else None

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def __enter__(self) -> _Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusAPI:
    """A tiny client of a Prometheus HTTP API at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; returns ``data`` or raises StackError."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise StackError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query; a list of ``{"metric": {...}, "value": [ts, "v"]}``."""
        return self.api("query", query=promql)["result"]


class Prometheus(PrometheusAPI, _Server):
    """Prometheus on 127.0.0.1 with a temporary TSDB; ``query()`` runs instant PromQL queries."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        sd_dir: str | Path,
        rule_files: list[str | Path] | None = None,
        alertmanager: str | None = None,
        scrape_interval: str | None = None,
        evaluation_interval: str | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.config = prometheus_config(
            sd_dir=sd_dir,
            rule_files=list(rule_files or []),
            alertmanager=alertmanager,
            scrape_interval=scrape_interval,
            evaluation_interval=evaluation_interval,
        )
        self.config_path = self.workdir / "prometheus.yml"
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            find_binary("prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        self._process = ManagedProcess("prometheus", cmd, self.workdir / "prometheus.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/-/ready", timeout)
        return self


class Alertmanager(_Server):
    """Alertmanager on 127.0.0.1 (clustering off) sending every notification to a webhook."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        webhook_url: str,
        group_wait: str | None = None,
        group_interval: str | None = None,
        repeat_interval: str | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.config = alertmanager_config(
            webhook_url=webhook_url,
            group_wait=group_wait,
            group_interval=group_interval,
            repeat_interval=repeat_interval,
        )
        self.config_path = self.workdir / "alertmanager.yml"
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> Alertmanager:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            find_binary("prometheus-alertmanager", "alertmanager"),
            f"--config.file={self.config_path}",
            f"--storage.path={self.workdir / 'am-data'}",
            f"--web.listen-address={self.address}",
            "--cluster.listen-address=",  # no gossip port on all interfaces
            "--log.level=warn",
        ]
        self._process = ManagedProcess("alertmanager", cmd, self.workdir / "alertmanager.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/-/ready", timeout)
        return self

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=10) as resp:
            return json.load(resp)


def write_rule_files(directory: str | Path, cfg: Any = None) -> list[Path]:
    """Generate the rule files for ``cfg`` (a MixinConfig; default: the shipped one)."""
    return render.write(directory, cfg)
