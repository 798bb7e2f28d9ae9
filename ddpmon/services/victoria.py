"""VictoriaMetrics (Debian's ``victoria-metrics`` 1.79): the store, ``vmagent`` and ``vmalert``.

The pieces of the scale-out path (docs/scale-out.md): scraper shards (``vmagent``, one
``hashmod`` share of the targets each) ``remote_write`` into the store; ``vmalert`` runs the
shipped rule files against the store, writes recorded series back and notifies Alertmanager.
Every process binds 127.0.0.1 and is stopped with its process group, like Prometheus.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ddpmon.mixin import shipped
from ddpmon.services.process import ManagedProcess, ManagedServer, find_binary, free_port
from ddpmon.services.prometheus import PrometheusAPI

SCALEOUT_DIR = "deploy/scaleout"
SHARD_SCRAPE_YML = f"{SCALEOUT_DIR}/vmagent-scrape.yml"
SHARD_PLACEHOLDER = "%{DDPMON_SHARD}"
SHARDS_PLACEHOLDER = "%{DDPMON_SHARDS}"


def shard_scrape_config(
    *,
    shard: int,
    shards: int,
    sd_dir: str | Path,
    scrape_interval: str | None = None,
    base: Path | None = None,
) -> dict[str, Any]:
    """The shipped ``deploy/scaleout/vmagent-scrape.yml`` for shard ``shard`` of ``shards``.

    The shipped file keeps ``%{DDPMON_SHARD}``/``%{DDPMON_SHARDS}`` placeholders (vmagent fills
    ``%{ENV}`` from its environment); here they are filled in, with the file_sd directory, so
    the file can be checked and read by a person."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
    text = (base or shipped.path(SHARD_SCRAPE_YML)).read_text()
    text = text.replace(SHARD_PLACEHOLDER, str(shard)).replace(SHARDS_PLACEHOLDER, str(shards))
    cfg = yaml.safe_load(text)
    glob = str(Path(sd_dir).resolve() / "*.json")
    for job in cfg["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [glob]
    if scrape_interval:
        cfg.setdefault("global", {})["scrape_interval"] = scrape_interval
        cfg["global"]["scrape_timeout"] = scrape_interval
    return copy.deepcopy(cfg)


class VictoriaMetrics(PrometheusAPI, ManagedServer):
    """Single-node VictoriaMetrics on 127.0.0.1; its Prometheus-compatible API at ``url``.

    ``search.latencyOffset`` is 0 here (default 30 s: samples younger than that are hidden from
    queries, which would delay every alert by 30 s); a store fed by vmagent every second has
    no late samples to wait for. Restartable on the same data directory (``stop()``/``start()``
    or ``kill()``/``start()``)."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        port: int | None = None,
        latency_offset: str = "0s",
        extra_args: list[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.data_dir = self.workdir / "data"
        self.write_url = f"{self.url}/api/v1/write"
        self.latency_offset = latency_offset
        self.extra_args = list(extra_args or [])
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> VictoriaMetrics:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_binary("victoria-metrics"),
            f"-storageDataPath={self.data_dir}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-retentionPeriod=1y",
            f"-search.latencyOffset={self.latency_offset}",
            "-loggerLevel=WARN",
            *self.extra_args,
        ]
        self._process = ManagedProcess("victoria-metrics", cmd, self.workdir / "vm.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/health", timeout)
        return self

    def kill(self) -> None:
        """SIGKILL, no flush: the crash a restart test wants (data written so far survives)."""
        if self._process is not None and self._process.proc is not None:
            os.killpg(self._process.proc.pid, signal.SIGKILL)
            self._process.proc.wait(timeout=10)

    def flush(self) -> None:
        """Make just-ingested samples searchable now (VM buffers them for up to a second)."""
        with urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=10):
            pass


class VMAgent(ManagedServer):
    """One scraper shard: ``vmagent`` with :func:`shard_scrape_config`, remote-writing to
    ``remote_write_url`` and buffering on disk (``tmpDataPath``) while the store is away."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        shard: int,
        shards: int,
        sd_dir: str | Path,
        remote_write_url: str,
        scrape_interval: str | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.shard, self.shards = shard, shards
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.remote_write_url = remote_write_url
        self.config = shard_scrape_config(
            shard=shard, shards=shards, sd_dir=sd_dir, scrape_interval=scrape_interval
        )
        self.config_path = self.workdir / "scrape.yml"
        self._process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> VMAgent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            find_binary("vmagent"),
            f"-promscrape.config={self.config_path}",
            "-promscrape.config.strictParse",
            "-promscrape.fileSDCheckInterval=1s",
            f"-remoteWrite.url={self.remote_write_url}",
            f"-remoteWrite.tmpDataPath={self.workdir / 'buffer'}",
            "-remoteWrite.flushInterval=1s",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-loggerLevel=WARN",
            "-promscrape.suppressScrapeErrors",
        ]
        self._process = ManagedProcess(
            f"vmagent shard {self.shard}", cmd, self.workdir / "vmagent.log"
        )
        self._process.start()
        self._process.wait_ready(f"{self.url}/health", timeout)
        return self

    def targets(self) -> list[dict]:
        """The shard's active targets (``/api/v1/targets``, Prometheus' shape)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            return json.load(resp)["data"]["activeTargets"]


class VMAlert(ManagedServer):
    """``vmalert`` running Prometheus rule files against ``datasource_url``: recorded series and
    alert state (``ALERTS``) go back through ``remote_write_url``, alerts to Alertmanager."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        rule_files: list[str | Path],
        datasource_url: str,
        remote_write_url: str,
        notifier_url: str | None,
        evaluation_interval: str = "5s",
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.datasource_url = datasource_url
        self.remote_write_url = remote_write_url
        self.notifier_url = notifier_url
        self.evaluation_interval = evaluation_interval
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: ManagedProcess | None = None

    def command(self) -> list[str]:
        cmd = [
            find_binary("vmalert"),
            *(f"-rule={p}" for p in self.rule_files),
            f"-datasource.url={self.datasource_url}",
            f"-remoteWrite.url={self.remote_write_url}",
            # Alert state survives a vmalert restart (ALERTS_FOR_STATE read back).
            f"-remoteRead.url={self.datasource_url}",
            f"-evaluationInterval={self.evaluation_interval}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-remoteWrite.flushInterval=1s",
            "-loggerLevel=WARN",
        ]
        if self.notifier_url:
            cmd.append(f"-notifier.url={self.notifier_url}")
        else:
            cmd.append("-notifier.blackhole")
        return cmd

    def start(self, timeout: float = 30.0) -> VMAlert:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._process = ManagedProcess("vmalert", self.command(), self.workdir / "vmalert.log")
        self._process.start()
        self._process.wait_ready(f"{self.url}/health", timeout)
        return self

    def alerts(self) -> list[dict]:
        """Active alerts as vmalert holds them (pending and firing)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10) as resp:
            return json.load(resp)["data"]["alerts"]

    def groups(self) -> list[dict]:
        """Rule groups with each rule's last error and evaluation time."""
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as resp:
            return json.load(resp)["data"]["groups"]
