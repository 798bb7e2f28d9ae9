"""The node daemon's own series (``ddpmon/daemon/node.py``), without run or rank: one per node.
Part of the catalogue (``ddpmon.metrics.NODE_CATALOGUE``)."""

from __future__ import annotations

from typing import Any

from .types import Layer, Metric, MetricType

G, C, H = MetricType.GAUGE, MetricType.COUNTER, MetricType.HISTOGRAM
L = Layer

# -- the node daemon's own series (ddpmon/daemon/node.py) -----------------------------------
# One per node, without run or rank, so after CATALOGUE (a rank's series). The daemon also
# serves GPU_* and COLLECTOR_SUCCESS above, with their extra labels only.
_NODE, _HOST = "from the node daemon", "from the node daemon, through psutil"


def _node(name: str, kind: MetricType, help_: str, layer: Layer, **more: Any) -> Metric:
    return Metric(name, kind, help_, layer, base_labels=(), **{"when": _NODE, **more})


NODE_GPUS = _node("ddpmon_node_gpus", G, "GPUs NVML reports on this node.", L.IDENTITY)
NODE_GPU_INFO = _node("ddpmon_node_gpu_info", G, "GPU identity (value 1).", L.IDENTITY,
                      labels=("gpu", "gpu_uuid", "name", "pci_bus_id"))
GPU_ECC_UNCORRECTED = _node(
    "ddpmon_gpu_ecc_uncorrected_errors_total", C,
    "Uncorrected ECC errors since boot (NVML, aggregate), where supported.", L.MEMORY,
    labels=("gpu",),
)
NODE_INFO = _node("ddpmon_node_info", G, "This node (value 1).", L.IDENTITY, labels=("node",))
NODE_CPU_SECONDS = _node("ddpmon_node_cpu_seconds_total", C, "CPU time of the host by mode.",
                         L.IDENTITY, unit="seconds", labels=("mode",), when=_HOST)
NODE_CPUS = _node("ddpmon_node_cpus", G, "Logical CPUs of the host.", L.IDENTITY, when=_HOST)
NODE_LOAD1 = _node("ddpmon_node_load1", G, "1-minute load average.", L.IDENTITY, when=_HOST)
NODE_MEMORY_TOTAL = _node("ddpmon_node_memory_total_bytes", G, "Host memory size.", L.MEMORY,
                          unit="bytes", when=_HOST)
NODE_MEMORY_AVAILABLE = _node("ddpmon_node_memory_available_bytes", G, "Host memory available.",
                              L.MEMORY, unit="bytes", when=_HOST)
NODE_DISK_TOTAL = _node("ddpmon_node_disk_total_bytes", G, "Filesystem size.", L.IDENTITY,
                        unit="bytes", labels=("path",), when=_HOST)
NODE_DISK_FREE = _node("ddpmon_node_disk_free_bytes", G, "Filesystem space free.", L.IDENTITY,
                       unit="bytes", labels=("path",), when=_HOST)
NODE_NETWORK_RECEIVE = _node("ddpmon_node_network_receive_bytes_total", C,
                             "Bytes received per interface.", L.COMMUNICATION, unit="bytes",
                             labels=("device",), when=_HOST)
NODE_NETWORK_TRANSMIT = _node("ddpmon_node_network_transmit_bytes_total", C,
                              "Bytes sent per interface.", L.COMMUNICATION, unit="bytes",
                              labels=("device",), when=_HOST)
DAEMON_JOBS = _node("ddpmon_daemon_jobs", G, "Jobs known to the daemon by state.", L.IDENTITY,
                    labels=("state",))
DAEMON_REGISTERED_RANKS = _node("ddpmon_daemon_registered_ranks", G, "Live ranks listed by /sd.",
                                L.IDENTITY)
COLLECTOR_DURATION = _node("ddpmon_collector_duration_seconds", G,
                           "Time spent reading the source.", L.IDENTITY, unit="seconds",
                           labels=("collector",))


NODE_CATALOGUE: tuple[Metric, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Metric)
)
"""The node daemon's own series, in exposition order (it serves GPU_* and COLLECTOR_SUCCESS
of CATALOGUE too)."""
