"""torch CUDA caching-allocator statistics. Host-side counters only: no device sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AllocatorReading:
    allocated_bytes: float
    reserved_bytes: float
    peak_allocated_bytes: float
    alloc_retries_total: float
    ooms_total: float


class AllocatorSource:
    """Reads ``torch.cuda.memory_stats(device)``; ``stats_fn`` may be injected for tests."""

    def __init__(self, device: Any, stats_fn: Any | None = None) -> None:
        self._device = device
        if stats_fn is None:
            stats_fn = torch.cuda.memory_stats
        self._stats_fn = stats_fn

    def read(self) -> AllocatorReading:
        stats = self._stats_fn(self._device)
        return AllocatorReading(
            allocated_bytes=float(stats.get("allocated_bytes.all.current", 0)),
            reserved_bytes=float(stats.get("reserved_bytes.all.current", 0)),
            peak_allocated_bytes=float(stats.get("allocated_bytes.all.peak", 0)),
            alloc_retries_total=float(stats.get("num_alloc_retries", 0)),
            ooms_total=float(stats.get("num_ooms", 0)),
        )
