"""Builds the rank's metric families at scrape time from ``MetricState`` and live readings.

Follows prometheus_client's process_collector: a small class with ``collect()``, its sources
injected, registered on ddpmon's own registry (never the global one). ``Exposition`` caches the
rendered bytes, so a scrape re-renders only when a step completed or live readings were
refreshed (at most every ``live_refresh_seconds``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .. import metrics as m
from ..job.identity import RankIdentity
from ..metrics.state import Histogram, MetricState
from ..metrics.step_fields import EXPORTED, Fold
from ..sources.allocator import AllocatorReading
from ..sources.host import ProcessReading
from ..sources.nvml import GpuReading
from ..strategies.registry import reduced_norms_identical

log = logging.getLogger("ddpmon.collector")


@dataclass(slots=True)
class LiveReadings:
    """Latest readings of the live sources, refreshed lazily at scrape time."""

    process: ProcessReading | None = None
    allocator: AllocatorReading | None = None
    gpus: list[GpuReading] = field(default_factory=list)
    success: dict[str, bool] = field(default_factory=dict)
    version: int = 0
    refreshed_at: float = 0.0


class LiveSources:
    """Reads psutil, the CUDA allocator and NVML, each optional and each failure-isolated."""

    def __init__(
        self,
        *,
        process: Any | None,
        allocator: Any | None,
        nvml: Any | None,
        gpu_indices: list[int] | None,
        min_interval: float,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._process = process
        self._allocator = allocator
        self._nvml = nvml
        self._gpu_indices = gpu_indices
        self._min_interval = min_interval
        self._on_error = on_error
        self._lock = threading.Lock()
        self.readings = LiveReadings()

    def refresh_if_stale(self) -> LiveReadings:
        with self._lock:
            now = time.monotonic()
            if self.readings.version and now - self.readings.refreshed_at < self._min_interval:
                return self.readings
            new = LiveReadings(version=self.readings.version + 1, refreshed_at=now)
            if self._process is not None:
                new.process = self._read("process", self._process.read, new)
            if self._allocator is not None:
                new.allocator = self._read("allocator", self._allocator.read, new)
            if self._nvml is not None:
                if self._nvml.available and self._gpu_indices:
                    gpus = self._read("nvml", lambda: self._nvml.read(self._gpu_indices), new)
                    new.gpus = gpus or []
                else:
                    new.success["nvml"] = False
            self.readings = new
            return new

    def _read(self, name: str, fn: Callable[[], Any], into: LiveReadings) -> Any:
        try:
            value = fn()
            into.success[name] = True
            return value
        except Exception as exc:
            into.success[name] = False
            self._on_error(name, exc)
            return None




def exports_group_norms(profile: str, rank: int, strategy: str) -> bool:
    """Whether this rank exports ``ddpmon_grad_group_norm`` under ``series_profile``.

    ``large``: only rank 0, where every rank's copy is the same (``reduced_norms_identical``).
    Rank 0 because it always exists and is the rank a dashboard falls back to; a lost rank 0 is
    a RankDown page of its own. The global norm stays on every rank: one series each, and the
    copies are what DdpmonGradDesync compares to catch replicas that diverged."""
    return profile != "large" or rank == 0 or not reduced_norms_identical(strategy)


class DdpmonCollector(Collector):
    """Yields one family per catalogue entry that has data, in catalogue order."""

    def __init__(
        self,
        state: MetricState,
        identity: RankIdentity,
        run_id: str,
        versions: dict[str, str],
        live: LiveSources | None = None,
        series_profile: str = "full",
    ) -> None:
        self.state = state
        self.identity = identity
        self.run_id = run_id
        self.versions = versions
        self.live = live
        self.series_profile = series_profile
        self.at_scrape: Callable[[], dict[m.Metric, Samples]] | None = None
        """Families read fresh at every scrape (the rank's activity, ``agent.activity``)."""
        self.at_scrape_error: Callable[[str, BaseException], None] | None = None
        """Counts a failure of ``at_scrape`` (probe ``activity``); the rest is still served."""

    def collect(self) -> Iterator[Metric]:
        live = self.live.refresh_if_stale() if self.live is not None else None
        scraped = self._scraped()  # first: a failure it counts is in this scrape's errors
        values = self._state_values()
        if live is not None:
            values.update(_live_values(live))
        values.update(scraped)
        base = [self.run_id, str(self.identity.rank)]
        for metric in m.CATALOGUE:
            samples = values.pop(metric, None)
            if samples is not None:
                yield _family(metric, base, samples)
        for metric, samples in values.items():  # a per-step metric declared outside the catalogue
            yield _family(metric, base, samples)

    def _scraped(self) -> dict[m.Metric, Samples]:
        """``at_scrape``'s families; a failure is counted and the rest of /metrics served."""
        if self.at_scrape is None:
            return {}
        try:
            return self.at_scrape()
        except Exception as exc:  # noqa: BLE001 - one probe never turns /metrics into a 500
            if self.at_scrape_error is not None:
                self.at_scrape_error("activity", exc)
            else:
                log.debug("at-scrape families failed", exc_info=True)
            return {}

    def _state_values(self) -> dict[m.Metric, Samples]:
        s, ident = self.state, self.identity
        out: dict[m.Metric, Samples] = {
            m.RANK_INFO: [
                (
                    (
                        str(ident.local_rank),
                        str(ident.world_size),
                        ident.node,
                        ident.backend,
                        ident.device,
                        ident.gpu_uuid,
                        str(ident.pid),
                        s.strategy,
                        s.precision,
                    ),
                    1,
                )
            ],
            m.BUILD_INFO: [
                (tuple(self.versions.get(k, "") for k in m.BUILD_INFO.labels), 1)
            ],
            m.WORLD_SIZE: _one(ident.world_size),
            m.STEP: _one(s.step),
            m.STEPS: _one(s.steps_total),
            m.LAST_STEP_TIMESTAMP: _one(s.last_step_timestamp or s.started_at),
            **_step_parts(s),
            m.LOSS_NONFINITE: _one(s.loss_nonfinite_total),
            m.AGENT_ERRORS: [((probe,), n) for probe, n in sorted(dict(s.agent_errors).items())],
            **_step_fields(s),
        }
        if s.replica_mismatch_total is not None:
            out[m.REPLICA_MISMATCH] = _one(s.replica_mismatch_total)
        reruns = s.step_reruns_total
        if reruns is not None:
            out[m.STEP_RERUNS] = [((v,), float(n)) for v, n in sorted(dict(reruns).items())]
        if s.stall_threshold_seconds is not None:
            out[m.STALL_THRESHOLD] = _one(s.stall_threshold_seconds)
        if s.group_norms and exports_group_norms(self.series_profile, ident.rank, s.strategy):
            out[m.GRAD_GROUP_NORM] = [((g, ), v) for g, v in list(s.group_norms.items())]
        if s.update_ratios:
            out[m.UPDATE_RATIO] = [((g,), v) for g, v in list(s.update_ratios.items())]
        if s.logit_max:
            out[m.LOGIT_MAX] = [((name,), v) for name, v in list(s.logit_max.items())]
        if s.loss_spike_unrecovered_step is not None:
            out[m.LOSS_SPIKE_UNRECOVERED] = _one(s.loss_spike_unrecovered_step)
        if s.collective_duration or s.collective_bytes_total:
            out[m.COLLECTIVE_DURATION] = [
                ((op,), hist) for op, hist in _by_op(s.collective_duration)
            ]
            out[m.COLLECTIVE_BYTES] = [((op,), n) for op, n in _by_op(s.collective_bytes_total)]
        first = s.first_nonfinite
        if first is not None:
            out[m.GRAD_FIRST_NONFINITE_INFO] = [((str(first.step), first.param, first.kind), 1)]
        out[m.ATTEMPT] = _one(s.attempt)
        if s.checkpoint_last_step is not None:
            out[m.CHECKPOINT_LAST_STEP] = _one(s.checkpoint_last_step)
        if s.checkpoint_last_timestamp is not None:
            out[m.CHECKPOINT_LAST_TIMESTAMP] = _one(s.checkpoint_last_timestamp)
        if s.checkpoint_duration:
            out[m.CHECKPOINT_DURATION] = [
                ((kind,), hist) for kind, hist in sorted(dict(s.checkpoint_duration).items())
            ]
        if s.checkpoint_size_bytes is not None:
            out[m.CHECKPOINT_SIZE] = _one(s.checkpoint_size_bytes)
        if s.amp_enabled:
            if s.loss_scale is not None:
                out[m.AMP_LOSS_SCALE] = _one(s.loss_scale)
            out[m.AMP_LOSS_SCALE_FLOOR] = _one(s.loss_scale_floor)
        for metric, value in list(s.step_values.items()):
            out[metric] = _one(value)
        if s.steps_skipped_total:
            skipped = dict(s.steps_skipped_total)  # one C-level copy: the record thread adds
            out[m.STEPS_SKIPPED] = [((by,), float(n)) for by, n in skipped.items()]
        return out


Samples = (
    list[tuple[tuple[str, ...], float]] | Histogram | list[tuple[tuple[str, ...], Histogram]]
)
"""A family's samples: (extra label values, value) pairs, a histogram, or labelled
histograms."""


_OP_ORDER = {op: i for i, op in enumerate(m.COLLECTIVE_OPS)}


def _by_op(values: dict) -> list[tuple[str, Any]]:
    """``(op, value)`` pairs in ``COLLECTIVE_OPS`` order (a snapshot: the record thread may add
    an op)."""
    items = dict(values)
    return sorted(items.items(), key=lambda kv: _OP_ORDER.get(kv[0], len(_OP_ORDER)))


def _step_fields(s: MetricState) -> dict[m.Metric, Samples]:
    """The declared step fields' series (``step_fields.EXPORTED``): a histogram, a count of
    steps (from 0), or a last value (once there is one)."""
    out: dict[m.Metric, Samples] = {}
    for f in EXPORTED:
        value = getattr(s, f.state_name)
        if f.fold is Fold.HISTOGRAM:
            out[f.metric] = value
        elif value is not None:
            out[f.metric] = _one(value)
    return out


def _step_parts(s: MetricState) -> dict[m.Metric, Samples]:
    """The step's parts, where the rank's series budget has room (at most 3 collective ops)."""
    parts = dict(s.step_part_seconds_total)
    if not parts or len(s.collective_duration) > 3:
        return {}
    return {m.STEP_PART_SECONDS: [((part, s.stage), v) for part, v in sorted(parts.items())]}


def _one(value: float) -> Samples:
    return [((), value)]


GPU_ATTRS = {
    m.GPU_MEMORY_USED: "memory_used_bytes",
    m.GPU_MEMORY_TOTAL: "memory_total_bytes",
    m.GPU_UTILIZATION: "utilization_ratio",
    m.GPU_TEMPERATURE: "temperature_celsius",
    m.GPU_POWER: "power_watts",
}


def _live_values(live: LiveReadings) -> dict[m.Metric, Samples]:
    out: dict[m.Metric, Samples] = {}
    if (a := live.allocator) is not None:
        out[m.CUDA_MEMORY_ALLOCATED] = _one(a.allocated_bytes)
        out[m.CUDA_MEMORY_RESERVED] = _one(a.reserved_bytes)
        out[m.CUDA_MEMORY_PEAK_ALLOCATED] = _one(a.peak_allocated_bytes)
        out[m.CUDA_ALLOC_RETRIES] = _one(a.alloc_retries_total)
        out[m.CUDA_OOMS] = _one(a.ooms_total)
    if live.gpus:
        for metric, attr in GPU_ATTRS.items():
            out[metric] = [
                ((str(gpu.index),), getattr(gpu, attr))
                for gpu in live.gpus
                if getattr(gpu, attr) is not None
            ]
    if (p := live.process) is not None:
        out[m.PROCESS_RESIDENT_MEMORY] = _one(p.resident_memory_bytes)
        out[m.PROCESS_CPU_SECONDS] = _one(p.cpu_seconds_total)
    out[m.COLLECTOR_SUCCESS] = [
        ((name,), 1.0 if ok else 0.0) for name, ok in sorted(live.success.items())
    ]
    return out


_FAMILIES = {
    m.MetricType.GAUGE: GaugeMetricFamily,
    m.MetricType.COUNTER: CounterMetricFamily,
    m.MetricType.HISTOGRAM: HistogramMetricFamily,
}


def _family(metric: m.Metric, base: list[str], samples: Samples) -> Metric:
    """One family with the catalogue's name, type, help, unit and labels."""
    fam = _FAMILIES[metric.type](
        metric.family, metric.help, labels=list(metric.all_labels), unit=metric.unit
    )
    if isinstance(samples, Histogram):
        buckets, total, _count = samples.cumulative()
        fam.add_metric(base, buckets, total)
    else:
        for extra, value in samples:
            if isinstance(value, Histogram):
                buckets, total, _count = value.cumulative()
                fam.add_metric([*base, *extra], buckets, total)
            else:
                fam.add_metric([*base, *extra], value)
    return fam


class Exposition:
    """ddpmon's own registry plus a cache of the rendered text format. ``catch_up``: called
    before each render, so a scrape sees every step whose values have arrived."""

    def __init__(
        self, collector: DdpmonCollector, catch_up: Callable[[], None] | None = None
    ) -> None:
        self._catch_up = catch_up
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._collector = collector
        self._lock = threading.Lock()
        self._key: tuple[int, ...] | None = None
        self._payload = b""
        self.renders = 0
        self._extra: list[Any] = []

    def add(self, collector: Any) -> None:
        """Serve another collector's families too; its ``version`` joins the cache key."""
        self.registry.register(collector)
        self._extra.append(collector)

    def close(self) -> None:
        """Stop the added collectors that run threads of their own (``close``)."""
        for c in self._extra:
            close = getattr(c, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - closing never raises
                    log.debug("closing %r failed", c, exc_info=True)

    def serve_at_scrape(self, families: Callable[[], dict[m.Metric, Samples]],
                        on_error: Callable[[str, BaseException], None] | None = None) -> None:
        """Add families read fresh at each scrape (rendered at most once a second); a failure
        of ``families`` goes to ``on_error`` (probe ``activity``), never to the scraper."""
        self._collector.at_scrape = families
        self._collector.at_scrape_error = on_error

    def render(self) -> bytes:
        if self._catch_up is not None:
            self._catch_up()
        with self._lock:
            live = self._collector.live
            live_version = live.refresh_if_stale().version if live is not None else 0
            key = (self._collector.state.version, live_version,
                   time.monotonic() // 1 if self._collector.at_scrape is not None else 0,
                   *(c.version for c in self._extra))
            if key != self._key:
                self._payload = generate_latest(self.registry)
                self._key = key
                self.renders += 1
            return self._payload
