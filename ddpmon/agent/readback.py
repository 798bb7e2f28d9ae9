"""Lazy device->host readback of per-step values.

The training thread hands over one step's tensors by slot name (``push``); whoever drains the
queue later (the agent's record thread, or ``close``) takes the host values (``poll``).

- CPU: the tensors are already host memory, so nothing is done on the training thread: they are
  queued as they are and packed, read and split by name when polled.
- CUDA: the slots are packed into one float64 device vector and copied into pinned memory with
  ``non_blocking=True``, and a CUDA event is recorded; the values are taken only once
  ``event.query()`` says the copy is done.

- CPU, with a norm reduction still in flight (``deferred``: gloo's small all-reduce of the sharded
  strategies): the entry waits in the queue until the collective has completed
  (``DeferredReduction.done``), and is finished (norms filled) by whoever polls.

Nothing here waits on the device, except ``poll(wait=True)`` at close and a full queue (GPU far
behind, or a reduction not done: the oldest entry is waited for, counted in ``forced_waits``).
A full queue of CPU entries is the caller's cue to drain on its own thread (``full``), so memory
stays bounded and nothing is dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..host_reads import host_read_free_all
from .step_vector import Packed, StepVectorLayout


@dataclass(slots=True)
class Arrived:
    """One step's values, on the host now; ``parts()`` splits them by slot name."""

    meta: Any
    layout: StepVectorLayout
    host: Mapping[str, torch.Tensor | None] | list[float]
    key: Packed | None
    reduction_failed: bool = False
    """A host-side norm reduction of this step failed (reported): its reduced norms are void."""
    on_unreadable: Callable[[str, Exception], None] | None = None
    """Told of a slot that cannot be read (left out alone); None: that raises."""

    def parts(self) -> dict[str, list[float]]:
        if self.key is None:  # CPU tensors queued as they were: pack them now, off the hot path
            flat, key = self.layout.pack(self.host, self.on_unreadable)  # type: ignore[arg-type]
            return self.layout.unpack(flat or [], key)
        return self.layout.unpack(self.host, self.key)  # type: ignore[arg-type]


class Readback:
    def __init__(self, layout: StepVectorLayout | None = None, max_pending: int = 1024) -> None:
        self.layout = layout or StepVectorLayout()
        self._pending: deque[tuple[Any, Any, Packed | None, Any, Any]] = deque()
        self.max_pending = max_pending
        self.on_unreadable: Callable[[str, Exception], None] | None = None
        """Told of a slot whose value cannot be read back: it is left out alone, the step's
        other values stay (``StepVectorLayout.pack``). None: that raises (the whole step)."""
        self.forced_waits = 0
        """How often the queue was full and the oldest entry was waited for (GPU far behind)."""

    def push(
        self, values: Mapping[str, torch.Tensor | None], meta: Any, deferred: Any = None
    ) -> None:
        """Queue one step's slot tensors (``None``: absent). Training thread: no device read.
        ``deferred``: a ``DeferredReduction`` that fills some of those tensors later."""
        if host_read_free_all(values.values()):
            self._pending.append((values, None, None, meta, deferred))
            return
        if deferred is not None:  # packed below: the values must be final first
            deferred.finish()
        vector, key = self.layout.pack(values, self.on_unreadable)
        if not isinstance(vector, torch.Tensor):  # the device values were left out unreadable
            self._pending.append((torch.tensor(vector or [], dtype=torch.float64), None, key,
                                  meta, None))
            return
        host, event = _copy_to_host(vector)
        self._pending.append((host, event, key, meta, None))
        if len(self._pending) > self.max_pending:
            oldest = self._pending[0][1]
            if oldest is not None:
                oldest.synchronize()
                self.forced_waits += 1

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.max_pending

    def poll(self, wait: bool = False, collectives: bool = False) -> list[Arrived]:
        """Entries whose values are on the host, in push order; with ``wait``, all of them;
        with ``collectives``, also those whose host-side reduction is still in flight (waited
        for: the other ranks, not the device). One consumer at a time (the caller serialises)."""
        ready: list[Arrived] = []
        while self._pending:
            host, event, key, meta, deferred = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            if deferred is not None:
                if not deferred.done():
                    if not (wait or collectives or self.full):
                        break
                    self.forced_waits += 0 if wait or collectives else 1
                deferred.finish()
            self._pending.popleft()
            if key is not None:
                host = host.tolist()
            failed = deferred is not None and deferred.failed
            ready.append(Arrived(meta, self.layout, host, key, failed, self.on_unreadable))
        return ready

    def __len__(self) -> int:
        return len(self._pending)


def _copy_to_host(vector: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start the copy of ``vector`` into host memory without waiting for it: pinned memory and
    a CUDA event on CUDA. A CPU vector reaches here only under ``DDPMON_SYNC_AUDIT`` (the
    accelerator's branch, taken on the CPU): the same non-blocking copy, no event to wait on."""
    if not vector.is_cuda:
        host = torch.empty_like(vector)
        host.copy_(vector, non_blocking=True)
        return host, None
    host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
    host.copy_(vector, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
