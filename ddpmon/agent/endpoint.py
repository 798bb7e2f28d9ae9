"""The rank's /metrics endpoint and how Prometheus finds it (file_sd, the node daemon)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import Config
from ..export.collector import DdpmonCollector, Exposition, LiveSources
from ..export.delivery import linger_until
from ..export.discovery import FileSDPublisher
from ..export.registration import deregister_rank, register_rank
from ..export.server import MetricsServer, PortInUseError
from ..job.identity import RankIdentity, build_versions
from ..job.slurm import from_environ
from ..metrics.state import MetricState
from ..rundir.layout import sd_filename
from ..sources.allocator import AllocatorSource
from ..sources.host import ProcessSource
from ..sources.nvml import NvmlSource
from .guard import Guard

log = logging.getLogger("ddpmon")


class Endpoint:
    def __init__(self, exposition: Exposition) -> None:
        self.exposition = exposition
        self.server: Any = None
        self.port: int | None = None
        self._sd: Any = None
        self._daemon: tuple[str, dict] | None = None
        self.url: str | None = None
        self.opened_at = time.monotonic()
        self.lingered: str = ""
        """How close() ended its linger: ``scraped``, ``timeout`` or ``no-wait``."""

    @classmethod
    def open(
        cls,
        state: MetricState,
        identity: RankIdentity,
        run_id: str,
        config: Config,
        guard: Guard,
        catch_up: Callable[[], None] | None = None,
    ) -> Endpoint:
        """``catch_up``: delivers pending step records before each scrape."""
        collector = _collector(state, identity, run_id, config, guard)
        endpoint = cls(Exposition(collector, catch_up))
        endpoint._serve(identity, config, state)
        endpoint._publish(identity, run_id, config, guard)
        if config.announce:
            print(
                f"ddpmon: rank {identity.rank} serves {endpoint.url or 'no endpoint'} "
                f"(run {run_id})",
                file=sys.stderr,
                flush=True,
            )
        return endpoint

    def _serve(self, ident: RankIdentity, cfg: Config, state: MetricState) -> None:
        if cfg.port == 0:
            return

        server = MetricsServer(
            self.exposition.render,
            bind=cfg.bind,
            port=cfg.port + ident.local_rank,
            web_config=cfg.web_config,
        )
        try:
            server.start()
        except PortInUseError as exc:
            log.warning("ddpmon: rank %d serves no metrics: %s", ident.rank, exc.strerror or exc)
            state.count_error("server")
            return
        except Exception as exc:  # bad web_config and the like: serve nothing, never insecurely
            log.error("ddpmon: rank %d serves no metrics: %s", ident.rank, exc)
            state.count_error("server")
            return
        self.server, self.port = server, server.port

    def _publish(self, ident: RankIdentity, run_id: str, cfg: Config, guard: Guard) -> None:
        if self.port is None:
            return
        host = socket.gethostname() if cfg.bind in ("0.0.0.0", "::", "") else cfg.bind
        target = f"{host}:{self.port}"
        scheme = "https" if getattr(self.server, "tls", False) else "http"
        self.url = f"{scheme}://{target}/metrics"
        labels = {
            "run": run_id,
            "rank": str(ident.rank),
            "node": ident.node,
            "local_rank": str(ident.local_rank),
        }

        job = from_environ()
        if job is not None:
            labels |= job.labels()
        sd_dir = cfg.sd_dir or os.environ.get("DDPMON_SD_DIR")
        if sd_dir:
            with guard("discovery"):
                self._sd = FileSDPublisher(
                    sd_dir, target=target, labels=labels, filename=sd_filename(run_id, ident.rank)
                )
                self._sd.publish()
        if cfg.daemon_url:
            with guard("discovery"):
                info = {
                    **labels,
                    "pid": ident.pid,
                    "port": self.port,
                    "target": target,
                    "job_id": os.environ.get("DDPMON_JOB_ID", ""),
                }
                register_rank(cfg.daemon_url, info)
                self._daemon = (cfg.daemon_url, info)

    def linger(self, seconds: float, final_at: float, rank: int) -> str:
        """Keep serving until a store's scraper took an answer rendered at or after
        ``final_at`` (monotonic), within the bound of ``delivery.linger_until``. Returns how it
        ended: ``scraped``, ``timeout`` or ``no-wait``."""

        if self.server is None:
            self.lingered = "no-wait"
            return self.lingered
        deliveries = self.server.deliveries
        deadline = linger_until(
            now=time.monotonic(),
            linger_seconds=seconds,
            store_scraped=deliveries.store_scrapes > 0,
            published=self._sd is not None or self._daemon is not None,
            opened_at=self.opened_at,
        )
        if deadline is None:
            self.lingered = "no-wait"
        elif deliveries.wait_for_store_scrape(final_at, deadline):
            self.lingered = "scraped"
        else:
            self.lingered = "timeout"
            interval = deliveries.store_interval
            if rank == 0 and interval is not None and interval > seconds:
                log.warning(
                    "ddpmon: the store's scraper did not come back within linger_seconds=%g "
                    "(it scrapes every %.0f s): the final steps may be missing from the store; "
                    "set linger_seconds a little over the scrape interval",
                    seconds,
                    interval,
                )
        return self.lingered

    def close(self) -> None:
        self.exposition.close()
        if self._sd is not None:
            try:
                self._sd.remove()
            except Exception:
                pass
        if self._daemon is not None:
            try:
                deregister_rank(*self._daemon)
            except Exception:
                pass
        if self.server is not None:
            self.server.close()
            self.server = None


def _collector(
    state: MetricState, ident: RankIdentity, run_id: str, cfg: Config, guard: Guard
) -> DdpmonCollector:
    allocator = gpu_indices = None
    if ident.device.startswith("cuda"):
        allocator = AllocatorSource(torch.device(ident.device))
        gpu_indices = [torch.device(ident.device).index or 0]
    process = None
    with guard("process"):
        process = ProcessSource()
    live = LiveSources(
        process=process,
        allocator=allocator,
        nvml=NvmlSource(),
        gpu_indices=gpu_indices,
        min_interval=cfg.live_refresh_seconds,
        on_error=guard.error,
    )
    return DdpmonCollector(
        state, ident, run_id, build_versions(), live, series_profile=cfg.series_profile
    )
