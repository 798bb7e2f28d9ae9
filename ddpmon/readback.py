"""Lazy device->host readback of per-step vectors.

On CPU the values are already host memory and arrive as a list: available at once. On CUDA the
vector is copied into pinned memory with ``non_blocking=True`` and a CUDA event is recorded; the
values are taken only once ``event.query()`` says the copy is done, at a later step. Nothing here
waits on the device, except ``poll(wait=True)`` at close and a full queue (GPU far behind).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


class Readback:
    def __init__(self, max_pending: int = 64) -> None:
        self._pending: deque[tuple[Any, Any, Any]] = deque()
        self._max_pending = max_pending
        self.forced_waits = 0
        """How often the queue was full and the oldest entry was waited for (GPU far behind)."""

    def push(self, vector: torch.Tensor | list[float] | None, meta: Any) -> None:
        if vector is None or isinstance(vector, list):
            self._pending.append((vector or [], None, meta))
            return
        if vector.device.type == "cpu":
            self._pending.append((vector.tolist(), None, meta))
            return
        host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
        host.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event, meta))
        if len(self._pending) > self._max_pending:
            self._pending[0][1].synchronize()
            self.forced_waits += 1

    def poll(self, wait: bool = False) -> list[tuple[list[float], Any]]:
        """Completed entries in push order; with ``wait``, all of them (used at close)."""
        ready: list[tuple[list[float], Any]] = []
        while self._pending:
            host, event, meta = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            self._pending.popleft()
            ready.append((host if isinstance(host, list) else host.tolist(), meta))
        return ready

    def __len__(self) -> int:
        return len(self._pending)
