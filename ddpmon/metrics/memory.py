"""The memory layer's series (the CUDA allocator, NVML, the process), read at scrape time.
Part of the catalogue (``ddpmon.metrics``), between communication and the agent's health."""

from __future__ import annotations

from .types import Layer, Metric, MetricType

G, C, H = MetricType.GAUGE, MetricType.COUNTER, MetricType.HISTOGRAM
L = Layer

# -- memory (live sources, read at scrape time) --------------------------------------------
_ALLOC = "with the CUDA allocator"
CUDA_MEMORY_ALLOCATED = Metric(
    "ddpmon_cuda_memory_allocated_bytes",
    G,
    "Allocator: bytes in tensors.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_MEMORY_RESERVED = Metric(
    "ddpmon_cuda_memory_reserved_bytes",
    G,
    "Allocator: bytes reserved.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_MEMORY_PEAK_ALLOCATED = Metric(
    "ddpmon_cuda_memory_peak_allocated_bytes",
    G,
    "Allocator: peak bytes in tensors.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_ALLOC_RETRIES = Metric(
    "ddpmon_cuda_alloc_retries_total", C, "Allocator retries.", L.MEMORY, when=_ALLOC
)
CUDA_OOMS = Metric(
    "ddpmon_cuda_ooms_total", C, "Allocator out-of-memory errors.", L.MEMORY, when=_ALLOC
)
_NVML = "with NVML"
GPU_MEMORY_USED = Metric(
    "ddpmon_gpu_memory_used_bytes",
    G,
    "NVML: device memory used.",
    L.MEMORY,
    unit="bytes",
    labels=("gpu",),
    when=_NVML,
)
GPU_MEMORY_TOTAL = Metric(
    "ddpmon_gpu_memory_total_bytes",
    G,
    "NVML: device memory total.",
    L.MEMORY,
    unit="bytes",
    labels=("gpu",),
    when=_NVML,
)
GPU_UTILIZATION = Metric(
    "ddpmon_gpu_utilization_ratio",
    G,
    "NVML: GPU utilisation 0-1.",
    L.MEMORY,
    unit="ratio",
    labels=("gpu",),
    when=_NVML,
)
GPU_TEMPERATURE = Metric(
    "ddpmon_gpu_temperature_celsius",
    G,
    "NVML: GPU temperature.",
    L.MEMORY,
    unit="celsius",
    labels=("gpu",),
    when=_NVML,
)
GPU_POWER = Metric(
    "ddpmon_gpu_power_watts",
    G,
    "NVML: power draw.",
    L.MEMORY,
    unit="watts",
    labels=("gpu",),
    when=_NVML,
)
PROCESS_RESIDENT_MEMORY = Metric(
    "ddpmon_process_resident_memory_bytes",
    G,
    "Resident memory of this rank's process.",
    L.MEMORY,
    unit="bytes",
    when="with psutil",
)
PROCESS_CPU_SECONDS = Metric(
    "ddpmon_process_cpu_seconds_total",
    C,
    "CPU time of this rank's process.",
    L.MEMORY,
    unit="seconds",
    when="with psutil",
)


MEMORY: tuple[Metric, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Metric)
)
"""The memory layer's series, in exposition order."""
