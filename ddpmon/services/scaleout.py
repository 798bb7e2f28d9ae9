"""The scale-out path on one machine: scraper shards -> VictoriaMetrics <- vmalert -> Alertmanager.

``ScaleOut`` starts, in order, the store, Alertmanager (the shipped config, webhooks pointed at
``webhook_url``), ``vmalert`` with the rule files generated for a :class:`MixinConfig` (the
shipped ones for the default config), and ``shards`` vmagents splitting the file_sd targets with
``hashmod``. ``ddpmon scaleout`` and ``tests/scaleout`` use it; docs/scale-out.md is the recipe.
Everything binds 127.0.0.1; ``stop()`` (or leaving the ``with`` block) stops every process,
also when a later one failed to start.
"""

from __future__ import annotations

from pathlib import Path

from ddpmon.mixin import render
from ddpmon.mixin.config import MixinConfig
from ddpmon.services.alertmanager import Alertmanager
from ddpmon.services.process import ManagedServer, free_port
from ddpmon.services.victoria import VictoriaMetrics, VMAgent, VMAlert

PORTS = 3
"""Ports besides the shards': store, Alertmanager, vmalert; then one per shard."""


class ScaleOut:
    def __init__(
        self,
        workdir: str | Path,
        *,
        sd_dir: str | Path,
        webhook_url: str,
        config: MixinConfig | None = None,
        shards: int = 2,
        scrape_interval: str = "5s",
        evaluation_interval: str = "5s",
        group_wait: str | None = None,
        group_interval: str | None = None,
        base_port: int | None = None,
    ) -> None:
        """``base_port``: ``PORTS + shards`` consecutive ports from there (default: any)."""
        if shards < 1:
            raise ValueError(f"shards={shards}: expected >= 1")
        self.workdir = Path(workdir)
        self.config = config or MixinConfig()

        def port(i: int) -> int:
            return base_port + i if base_port else free_port()

        self.store = VictoriaMetrics(self.workdir / "store", port=port(0))
        self.alertmanager = Alertmanager(
            self.workdir / "alertmanager", webhook_url=webhook_url, group_wait=group_wait,
            group_interval=group_interval, repeat_interval="1h" if group_interval else None,
            port=port(1),
        )
        self.rule_files = render.write(self.workdir / "rules", self.config)
        self.ruler = VMAlert(
            self.workdir / "vmalert", rule_files=self.rule_files,
            datasource_url=self.store.url, remote_write_url=self.store.url,
            notifier_url=self.alertmanager.url, evaluation_interval=evaluation_interval,
            port=port(2),
        )
        self.shards = [
            VMAgent(
                self.workdir / f"shard-{i}", shard=i, shards=shards, sd_dir=sd_dir,
                remote_write_url=self.store.write_url, scrape_interval=scrape_interval,
                port=port(PORTS + i),
            )
            for i in range(shards)
        ]
        self._started: list[ManagedServer] = []

    @property
    def servers(self) -> list[ManagedServer]:
        return [self.store, self.alertmanager, self.ruler, *self.shards]

    def start(self) -> ScaleOut:
        try:
            for server in self.servers:
                server.start()
                self._started.append(server)
        except BaseException:
            self.stop()
            raise
        return self

    def exited(self) -> list[str]:
        """Servers that exited on their own (name and code); empty while all run."""
        out = []
        for server in self._started:
            code = server.poll()
            if code is not None:
                out.append(f"{type(server).__name__} ({code})")
        return out

    def stop(self) -> None:
        for server in reversed(self._started):
            server.stop()
        self._started.clear()

    def __enter__(self) -> ScaleOut:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
