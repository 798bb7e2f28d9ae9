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
    InfoMetricFamily,  # noqa: F401  (kept for users extending the collector)
    Metric,
)
from prometheus_client.registry import Collector

from ..identity import RankIdentity
from ..sources.allocator import AllocatorReading
from ..sources.host import ProcessReading
from ..sources.nvml import GpuReading
from ..state import MetricState

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


class DdpmonCollector(Collector):
    def __init__(
        self,
        state: MetricState,
        identity: RankIdentity,
        run_id: str,
        versions: dict[str, str],
        live: LiveSources | None = None,
    ) -> None:
        self.state = state
        self.identity = identity
        self.run_id = run_id
        self.versions = versions
        self.live = live

    # -- helpers ---------------------------------------------------------------------------
    def _labels(self, **extra: str) -> tuple[list[str], list[str]]:
        names = ["run", "rank", *extra]
        values = [self.run_id, str(self.identity.rank), *extra.values()]
        return names, values

    def _gauge(self, name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
        names, values = self._labels(**extra)
        fam = GaugeMetricFamily(name, doc, labels=names)
        fam.add_metric(values, value)
        return fam

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        names, values = self._labels()
        fam = CounterMetricFamily(name, doc, labels=names)
        fam.add_metric(values, value)
        return fam

    def _histogram(self, name: str, doc: str, hist: Any) -> HistogramMetricFamily:
        names, values = self._labels()
        buckets, total, _count = hist.cumulative()
        fam = HistogramMetricFamily(name, doc, labels=names)
        fam.add_metric(values, buckets, total)
        return fam

    # -- collect ---------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        s, ident = self.state, self.identity
        yield self._gauge(
            "ddpmon_rank_info",
            "Identity of this rank; join with DCGM series on gpu_uuid.",
            1,
            local_rank=str(ident.local_rank),
            world_size=str(ident.world_size),
            node=ident.node,
            backend=ident.backend,
            device=ident.device,
            gpu_uuid=ident.gpu_uuid,
            pid=str(ident.pid),
        )
        yield self._gauge(
            "ddpmon_build_info", "Versions of ddpmon and its stack.", 1, **self.versions
        )
        yield self._gauge("ddpmon_world_size", "Number of ranks the job expects.", ident.world_size)
        yield self._gauge("ddpmon_step", "Index of the last completed step.", s.step)
        yield self._counter(
            "ddpmon_steps", "Steps completed, skipped ones included.", s.steps_total
        )
        yield self._gauge(
            "ddpmon_last_step_timestamp_seconds",
            "Wall time of the last completed step (attach time before the first).",
            s.last_step_timestamp or s.started_at,
        )
        yield self._histogram("ddpmon_step_duration_seconds", "Step wall time.", s.step_duration)
        yield self._histogram(
            "ddpmon_data_wait_seconds",
            "Time from a step's end to the next step's start.",
            s.data_wait,
        )
        yield self._counter(
            "ddpmon_data_identical_batches",
            "Sampled steps where another rank's local gradients were bit-identical to this "
            "rank's: duplicated data shards.",
            s.data_identical_batches_total,
        )
        if s.loss is not None:
            yield self._gauge("ddpmon_loss", "Last observed loss.", s.loss)
        yield self._counter(
            "ddpmon_loss_nonfinite", "Non-finite losses observed.", s.loss_nonfinite_total
        )
        if s.grad_norm is not None:
            yield self._gauge(
                "ddpmon_grad_norm",
                "Global L2 norm of unscaled gradients after reduction.",
                s.grad_norm,
            )
        if s.grad_local_norm is not None:
            yield self._gauge(
                "ddpmon_grad_local_norm",
                "L2 norm of this rank's unscaled gradients before the all-reduce.",
                s.grad_local_norm,
            )
        if s.group_norms:
            names, values = self._labels(group="")
            fam = GaugeMetricFamily(
                "ddpmon_grad_group_norm",
                "L2 norm of unscaled gradients per module group.",
                labels=names,
            )
            for group, norm in list(s.group_norms.items()):
                fam.add_metric([*values[:-1], group], norm)
            yield fam
        yield self._counter(
            "ddpmon_grad_nonfinite_steps",
            "Steps whose reduced gradients held NaN or Inf.",
            s.grad_nonfinite_steps_total,
        )
        yield self._counter(
            "ddpmon_grad_nonfinite_origin_steps",
            "Steps where this rank's local gradients held NaN or Inf before the all-reduce.",
            s.grad_nonfinite_origin_steps_total,
        )
        first = s.first_nonfinite
        if first is not None:
            yield self._gauge(
                "ddpmon_grad_first_nonfinite_info",
                "First local non-finite gradient seen on this rank.",
                1,
                step=str(first.step),
                param=first.param,
                kind=first.kind,
            )
        if s.amp_enabled:
            if s.loss_scale is not None:
                yield self._gauge("ddpmon_amp_loss_scale", "Current AMP loss scale.", s.loss_scale)
            yield self._gauge(
                "ddpmon_amp_loss_scale_floor",
                "Configured loss scale floor; alerts compare against it.",
                s.loss_scale_floor,
            )
            yield self._counter(
                "ddpmon_amp_skipped_steps",
                "Optimizer steps skipped by the GradScaler.",
                s.amp_skipped_steps_total,
            )
        yield self._histogram(
            "ddpmon_allreduce_duration_seconds",
            "All-reduce time per gradient bucket, launch to completion.",
            s.allreduce_duration,
        )
        yield self._counter("ddpmon_allreduce_bytes", "Bytes all-reduced.", s.allreduce_bytes_total)
        yield from self._live_families()
        names, values = self._labels(probe="")
        errors = CounterMetricFamily(
            "ddpmon_agent_errors", "Probe failures; training went on.", labels=names
        )
        for probe, count in sorted(dict(s.agent_errors).items()):
            errors.add_metric([*values[:-1], probe], count)
        yield errors

    def _live_families(self) -> Iterator[Metric]:
        if self.live is None:
            return
        live = self.live.refresh_if_stale()
        if live.allocator is not None:
            a = live.allocator
            for name, doc, value in (
                (
                    "ddpmon_cuda_memory_allocated_bytes",
                    "Allocator: bytes in tensors.",
                    a.allocated_bytes,
                ),
                (
                    "ddpmon_cuda_memory_reserved_bytes",
                    "Allocator: bytes reserved.",
                    a.reserved_bytes,
                ),
                (
                    "ddpmon_cuda_memory_peak_allocated_bytes",
                    "Allocator: peak bytes in tensors.",
                    a.peak_allocated_bytes,
                ),
            ):
                yield self._gauge(name, doc, value)
            yield self._counter(
                "ddpmon_cuda_alloc_retries", "Allocator retries.", a.alloc_retries_total
            )
            yield self._counter("ddpmon_cuda_ooms", "Allocator out-of-memory errors.", a.ooms_total)
        if live.gpus:
            for name, doc, attr in (
                ("ddpmon_gpu_memory_used_bytes", "NVML: device memory used.", "memory_used_bytes"),
                (
                    "ddpmon_gpu_memory_total_bytes",
                    "NVML: device memory total.",
                    "memory_total_bytes",
                ),
                ("ddpmon_gpu_utilization_ratio", "NVML: GPU utilisation 0-1.", "utilization_ratio"),
                ("ddpmon_gpu_temperature_celsius", "NVML: GPU temperature.", "temperature_celsius"),
                ("ddpmon_gpu_power_watts", "NVML: power draw.", "power_watts"),
            ):
                names, values = self._labels(gpu="")
                fam = GaugeMetricFamily(name, doc, labels=names)
                for gpu in live.gpus:
                    value = getattr(gpu, attr)
                    if value is not None:
                        fam.add_metric([*values[:-1], str(gpu.index)], value)
                yield fam
        if live.process is not None:
            yield self._gauge(
                "ddpmon_process_resident_memory_bytes",
                "Resident memory of this rank's process.",
                live.process.resident_memory_bytes,
            )
            yield self._counter(
                "ddpmon_process_cpu_seconds",
                "CPU time of this rank's process.",
                live.process.cpu_seconds_total,
            )
        names, values = self._labels(collector="")
        fam = GaugeMetricFamily(
            "ddpmon_collector_success",
            "1 when a live source was read, 0 when it failed or is absent.",
            labels=names,
        )
        for collector, ok in sorted(live.success.items()):
            fam.add_metric([*values[:-1], collector], 1.0 if ok else 0.0)
        yield fam


class Exposition:
    """ddpmon's own registry plus a cache of the rendered text format."""

    def __init__(self, collector: DdpmonCollector) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._collector = collector
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._payload = b""
        self.renders = 0

    def render(self) -> bytes:
        with self._lock:
            live = self._collector.live
            live_version = live.refresh_if_stale().version if live is not None else 0
            key = (self._collector.state.version, live_version)
            if key != self._key:
                self._payload = generate_latest(self.registry)
                self._key = key
                self.renders += 1
            return self._payload
