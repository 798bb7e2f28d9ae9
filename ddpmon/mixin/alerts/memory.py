"""Memory alerts: allocator headroom, OOMs and allocator retries.

Device memory "used" (NVML) and the allocator's "reserved" bytes both include the caching
allocator's free blocks, so a well-tuned job reads near 100% on both and that is normal. The
headroom alert reads what tensors really hold (allocator "allocated", its highest value over
``gauge_window``) against the device's total. An OOM is critical; retries (the allocator freed
its cache and retried cudaMalloc) are a warning once they keep happening.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin.alerts import RANK, Alert
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.MEMORY


def alerts(c: MixinConfig) -> list[Alert]:
    return [
        Alert(
            "DdpmonGpuMemoryNearlyFull", L, "warning",
            f"{n.GPU_ALLOCATED_RATIO} > {c.gpu_memory_full_ratio:g}",
            c.gpu_memory_full_for,
            "Tensors fill nearly all of the GPU's memory.",
            f"{RANK}: tensors held {{{{ $value | humanizePercentage }}}} of GPU "
            f"{{{{ $labels.gpu }}}} at their highest in the last {c.gauge_window} (threshold "
            f"{c.gpu_memory_full_ratio:.0%}); a larger batch or sequence will run out of memory.",
        ),
        Alert(
            "DdpmonCudaOOM", L, "critical",
            f"increase({sel(c, m.CUDA_OOMS.name)}[{c.cuda_oom_window}]) > 0",
            c.cuda_oom_for,
            "The CUDA caching allocator ran out of memory.",
            f"{RANK}: the CUDA caching allocator raised out-of-memory errors in the last "
            f"{c.cuda_oom_window}.",
        ),
        Alert(
            "DdpmonCudaAllocRetries", L, "warning",
            f"increase({sel(c, m.CUDA_ALLOC_RETRIES.name)}[{c.cuda_retry_window}])"
            f" >= {c.cuda_retry_min}",
            c.cuda_retry_for,
            "The CUDA caching allocator keeps flushing its cache to find memory.",
            f"{RANK}: about {{{{ $value | humanize }}}} allocator retries in the last "
            f"{c.cuda_retry_window} (cache freed and cudaMalloc retried under memory "
            "pressure); each one stalls the step, and an OOM is near.",
        ),
    ]
