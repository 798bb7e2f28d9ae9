"""Alertmanager with the shipped ``alertmanager.yml`` on loopback (clustering off).

Every webhook of the shipped file is pointed at one local receiver; tests shorten the grouping
timers.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ddpmon.mixin import shipped
from ddpmon.services.process import ManagedProcess, ManagedServer, find_binary, free_port


def alertmanager_config(
    *,
    webhook_url: str,
    group_wait: str | None = None,
    group_interval: str | None = None,
    repeat_interval: str | None = None,
    base: Path | None = None,
) -> dict[str, Any]:
    """The shipped alertmanager.yml, every webhook pointed at ``webhook_url/<receiver>``.

    The timing overrides apply to the root route and every sub-route (tests want notifications
    within a second, not after the production ``group_wait``).
    """
    cfg = yaml.safe_load((base or shipped.path(shipped.ALERTMANAGER_YML)).read_text())
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


class Alertmanager(ManagedServer):
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


