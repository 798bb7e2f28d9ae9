"""Node-level metrics of the daemon: every GPU through NVML, the host through psutil, job states.

A collector in the prometheus_client style: fresh families at scrape time, sources injected
(``NvmlSource`` with a fake module, a fake psutil) and registered on the caller's registry.
A source that fails reports ``ddpmon_collector_success{collector=...} 0`` instead of failing
the scrape. Every series is declared in the metric catalogue (``ddpmon.metrics``:
``NODE_CATALOGUE``, and the GPU entries the agent serves too); this module reads the sources.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .. import metrics as m
from ..metrics.types import Metric as Series
from ..metrics.types import MetricType
from ..sources.nvml import NvmlSource
from .store import JOB_STATES

log = logging.getLogger("ddpmon.daemon.node")

__all__ = ["NodeCollector", "build_registry"]


def new_family(series: Series) -> GaugeMetricFamily | CounterMetricFamily:
    """An empty family of a catalogue entry (``ddpmon.metrics``): name, type, help and the
    labels beyond a rank's (the daemon's series carry no run or rank)."""
    kind = CounterMetricFamily if series.type is MetricType.COUNTER else GaugeMetricFamily
    return kind(series.family, series.help, labels=list(series.labels))


class NodeCollector(Collector):
    def __init__(
        self,
        *,
        node: str,
        nvml: NvmlSource,
        psutil_module: Any | None = None,
        job_counts: Callable[[], dict[str, int]] | None = None,
        live_ranks: Callable[[], int] | None = None,
        disk_paths: tuple[str, ...] = ("/",),
    ) -> None:
        if psutil_module is None:
            psutil_module = psutil
        self._node = node
        self._nvml = nvml
        self._psutil = psutil_module
        self._job_counts = job_counts
        self._live_ranks = live_ranks
        self._disk_paths = disk_paths

    def collect(self) -> Iterator[Metric]:
        success = new_family(m.COLLECTOR_SUCCESS)
        duration = new_family(m.COLLECTOR_DURATION)
        for name, fn in (("nvml", self._gpu), ("host", self._host), ("jobs", self._jobs)):
            start = time.perf_counter()
            try:
                families = list(fn())
                ok = 1.0
            except Exception as exc:
                log.debug("collector %s failed: %s", name, exc)
                families, ok = [], 0.0
            duration.add_metric([name], time.perf_counter() - start)
            success.add_metric([name], ok)
            yield from families
        yield success
        yield duration

    def _gpu(self) -> Iterator[Metric]:
        readings = self._nvml.read()  # raises when NVML is unavailable
        info = new_family(m.NODE_GPU_INFO)
        gauges = {
            "memory_used_bytes": new_family(m.GPU_MEMORY_USED),
            "memory_total_bytes": new_family(m.GPU_MEMORY_TOTAL),
            "utilization_ratio": new_family(m.GPU_UTILIZATION),
            "temperature_celsius": new_family(m.GPU_TEMPERATURE),
            "power_watts": new_family(m.GPU_POWER),
        }
        ecc = new_family(m.GPU_ECC_UNCORRECTED)
        for r in readings:
            gpu = str(r.index)
            info.add_metric([gpu, r.uuid, r.name, r.pci_bus_id or ""], 1.0)
            for attr, family in gauges.items():
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([gpu], float(value))
            if r.ecc_uncorrected_total is not None:
                ecc.add_metric([gpu], float(r.ecc_uncorrected_total))
        count = new_family(m.NODE_GPUS)
        count.add_metric([], float(len(readings)))
        yield count
        yield info
        yield from gauges.values()
        yield ecc

    def _host(self) -> Iterator[Metric]:
        ps = self._psutil
        node = new_family(m.NODE_INFO)
        node.add_metric([self._node], 1.0)
        yield node
        cpu = new_family(m.NODE_CPU_SECONDS)
        times = ps.cpu_times()
        for mode in ("user", "system", "idle", "iowait", "nice", "irq", "softirq", "steal"):
            if hasattr(times, mode):
                cpu.add_metric([mode], float(getattr(times, mode)))
        yield cpu
        ncpu = new_family(m.NODE_CPUS)
        ncpu.add_metric([], float(ps.cpu_count() or 0))
        yield ncpu
        try:
            load1 = ps.getloadavg()[0]
            load = new_family(m.NODE_LOAD1)
            load.add_metric([], float(load1))
            yield load
        except (AttributeError, OSError):
            pass
        vm = ps.virtual_memory()
        for series, value in ((m.NODE_MEMORY_TOTAL, vm.total),
                              (m.NODE_MEMORY_AVAILABLE, vm.available)):
            g = new_family(series)
            g.add_metric([], float(value))
            yield g
        total = new_family(m.NODE_DISK_TOTAL)
        free = new_family(m.NODE_DISK_FREE)
        for path in self._disk_paths:
            try:
                usage = ps.disk_usage(path)
            except OSError:
                continue
            total.add_metric([path], float(usage.total))
            free.add_metric([path], float(usage.free))
        yield total
        yield free
        rx = new_family(m.NODE_NETWORK_RECEIVE)
        tx = new_family(m.NODE_NETWORK_TRANSMIT)
        for dev, c in sorted(ps.net_io_counters(pernic=True).items()):
            rx.add_metric([dev], float(c.bytes_recv))
            tx.add_metric([dev], float(c.bytes_sent))
        yield rx
        yield tx

    def _jobs(self) -> Iterator[Metric]:
        if self._job_counts is not None:
            g = new_family(m.DAEMON_JOBS)
            counts = self._job_counts()
            for state in JOB_STATES:
                g.add_metric([state], float(counts.get(state, 0)))
            yield g
        if self._live_ranks is not None:
            r = new_family(m.DAEMON_REGISTERED_RANKS)
            r.add_metric([], float(self._live_ranks()))
            yield r


def build_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
