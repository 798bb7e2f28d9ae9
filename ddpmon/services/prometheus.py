"""Prometheus with the shipped ``prometheus.yml`` on loopback, and a tiny client of its API.

Only the machine-specific parts of the shipped file are replaced: the file_sd directory, rule
file paths, the listen port, the Alertmanager address and, for tests, the intervals.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ddpmon.mixin import shipped
from ddpmon.services.process import (
    ManagedProcess,
    ManagedServer,
    StackError,
    find_binary,
    free_port,
)


def prometheus_config(
    *,
    sd_dir: str | Path,
    rule_files: list[str | Path],
    alertmanager: str | None,
    scrape_interval: str | None = None,
    evaluation_interval: str | None = None,
    base: Path | None = None,
    http_sd_urls: list[str] | None = None,
) -> dict[str, Any]:
    """The shipped prometheus.yml (or ``base``, e.g. the Slurm one) with this machine's paths
    and addresses filled in: the file_sd directory, or the nodes' http_sd URLs."""
    cfg = yaml.safe_load((base or shipped.path(shipped.PROMETHEUS_YML)).read_text())
    glob = str(Path(sd_dir).resolve() / "*.json")
    for job in cfg["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [glob]
            if scrape_interval:
                sd["refresh_interval"] = scrape_interval
        if http_sd_urls is not None and job.get("http_sd_configs"):
            template = job["http_sd_configs"][0]
            job["http_sd_configs"] = [
                {**template, "url": url,
                 **({"refresh_interval": scrape_interval} if scrape_interval else {})}
                for url in http_sd_urls
            ]
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


class Prometheus(PrometheusAPI, ManagedServer):
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
        flags: list[str] | None = None,
        base: Path | None = None,
        http_sd_urls: list[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.flags = list(flags or [])
        """Extra command-line flags (e.g. ``--query.timeout=30m`` for a backfill)."""
        self._port_picked = port is None
        """The port was probed free here, so another one may be tried if it is taken first."""
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.config = prometheus_config(
            sd_dir=sd_dir,
            rule_files=list(rule_files or []),
            alertmanager=alertmanager,
            scrape_interval=scrape_interval,
            evaluation_interval=evaluation_interval,
            base=base,
            http_sd_urls=http_sd_urls,
        )
        self.config_path = self.workdir / "prometheus.yml"
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> Prometheus:
        """Start and wait until ready. A port probed free can be bound by another process before
        Prometheus binds it: with a port picked here, up to two other free ports are tried."""
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except StackError as exc:
                if (not self._port_picked or attempt == 2
                        or "address already in use" not in str(exc)):
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            find_binary("prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
            *self.flags,
        ]
        self._process = ManagedProcess("prometheus", cmd, self.workdir / "prometheus.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/-/ready", timeout)
        return self


