"""Node-level metrics of the daemon: every GPU through NVML, the host through psutil, job states.

A collector in the prometheus_client style: fresh families at scrape time, sources injected
(``NvmlSource`` with a fake module, a fake psutil) and registered on the caller's registry.
A source that fails reports ``ddpmon_collector_success{collector=...} 0`` instead of failing
the scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ..sources.nvml import NvmlSource
from .store import JOB_STATES

log = logging.getLogger("ddpmon.daemon.node")

__all__ = ["NodeCollector", "build_registry"]


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
        success = GaugeMetricFamily(
            "ddpmon_collector_success",
            "1 when the collector's source was read.",
            labels=["collector"],
        )
        duration = GaugeMetricFamily(
            "ddpmon_collector_duration_seconds",
            "Time spent reading the source.",
            labels=["collector"],
        )
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
        info = GaugeMetricFamily(
            "ddpmon_node_gpu_info",
            "GPU identity (value 1).",
            labels=["gpu", "gpu_uuid", "name", "pci_bus_id"],
        )
        gauges = {
            "memory_used_bytes": GaugeMetricFamily(
                "ddpmon_gpu_memory_used_bytes", "Device memory in use (NVML).", labels=["gpu"]
            ),
            "memory_total_bytes": GaugeMetricFamily(
                "ddpmon_gpu_memory_total_bytes", "Device memory size (NVML).", labels=["gpu"]
            ),
            "utilization_ratio": GaugeMetricFamily(
                "ddpmon_gpu_utilization_ratio", "GPU busy fraction (NVML).", labels=["gpu"]
            ),
            "temperature_celsius": GaugeMetricFamily(
                "ddpmon_gpu_temperature_celsius", "GPU temperature (NVML).", labels=["gpu"]
            ),
            "power_watts": GaugeMetricFamily(
                "ddpmon_gpu_power_watts", "GPU power draw (NVML).", labels=["gpu"]
            ),
        }
        ecc = CounterMetricFamily(
            "ddpmon_gpu_ecc_uncorrected_errors",
            "Uncorrected ECC errors since boot (NVML, aggregate), where supported.",
            labels=["gpu"],
        )
        for r in readings:
            gpu = str(r.index)
            info.add_metric([gpu, r.uuid, r.name, r.pci_bus_id or ""], 1.0)
            for attr, family in gauges.items():
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([gpu], float(value))
            if r.ecc_uncorrected_total is not None:
                ecc.add_metric([gpu], float(r.ecc_uncorrected_total))
        count = GaugeMetricFamily("ddpmon_node_gpus", "GPUs NVML reports on this node.")
        count.add_metric([], float(len(readings)))
        yield count
        yield info
        yield from gauges.values()
        yield ecc

    def _host(self) -> Iterator[Metric]:
        ps = self._psutil
        node = GaugeMetricFamily("ddpmon_node_info", "This node (value 1).", labels=["node"])
        node.add_metric([self._node], 1.0)
        yield node
        cpu = CounterMetricFamily(
            "ddpmon_node_cpu_seconds", "CPU time of the host by mode.", labels=["mode"]
        )
        times = ps.cpu_times()
        for mode in ("user", "system", "idle", "iowait", "nice", "irq", "softirq", "steal"):
            if hasattr(times, mode):
                cpu.add_metric([mode], float(getattr(times, mode)))
        yield cpu
        ncpu = GaugeMetricFamily("ddpmon_node_cpus", "Logical CPUs of the host.")
        ncpu.add_metric([], float(ps.cpu_count() or 0))
        yield ncpu
        try:
            load1 = ps.getloadavg()[0]
            load = GaugeMetricFamily("ddpmon_node_load1", "1-minute load average.")
            load.add_metric([], float(load1))
            yield load
        except (AttributeError, OSError):
            pass
        vm = ps.virtual_memory()
        for name, value, help_ in (
            ("ddpmon_node_memory_total_bytes", vm.total, "Host memory size."),
            ("ddpmon_node_memory_available_bytes", vm.available, "Host memory available."),
        ):
            g = GaugeMetricFamily(name, help_)
            g.add_metric([], float(value))
            yield g
        total = GaugeMetricFamily(
            "ddpmon_node_disk_total_bytes", "Filesystem size.", labels=["path"]
        )
        free = GaugeMetricFamily(
            "ddpmon_node_disk_free_bytes", "Filesystem space free.", labels=["path"]
        )
        for path in self._disk_paths:
            try:
                usage = ps.disk_usage(path)
            except OSError:
                continue
            total.add_metric([path], float(usage.total))
            free.add_metric([path], float(usage.free))
        yield total
        yield free
        rx = CounterMetricFamily(
            "ddpmon_node_network_receive_bytes", "Bytes received per interface.", labels=["device"]
        )
        tx = CounterMetricFamily(
            "ddpmon_node_network_transmit_bytes", "Bytes sent per interface.", labels=["device"]
        )
        for dev, c in sorted(ps.net_io_counters(pernic=True).items()):
            rx.add_metric([dev], float(c.bytes_recv))
            tx.add_metric([dev], float(c.bytes_sent))
        yield rx
        yield tx

    def _jobs(self) -> Iterator[Metric]:
        if self._job_counts is not None:
            g = GaugeMetricFamily(
                "ddpmon_daemon_jobs", "Jobs known to the daemon by state.", labels=["state"]
            )
            counts = self._job_counts()
            for state in JOB_STATES:
                g.add_metric([state], float(counts.get(state, 0)))
            yield g
        if self._live_ranks is not None:
            r = GaugeMetricFamily("ddpmon_daemon_registered_ranks", "Live ranks listed by /sd.")
            r.add_metric([], float(self._live_ranks()))
            yield r


def build_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
