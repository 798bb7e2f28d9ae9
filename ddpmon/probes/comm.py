"""Collective timing for every strategy: one recorder, one metric family, a fixed set of ops.

A gradient source (or any strategy code: pipeline stages, engine wrappers) owns one
:class:`CollectiveRecorder` (``GradientSource.collectives``) and reports each collective it can
see under one of :data:`OPS`. The step pipeline takes what was recorded once per step and the
record thread turns it into ``ddpmon_collective_duration_seconds{op}`` (histogram) and
``ddpmon_collective_bytes_total{op}`` (counter); only ops a rank has seen are exported.

Timing never synchronises:
- on CPU, wall time (``perf_counter``) from issue to completion: a synchronous call is done when
  it returns; an asynchronous one (a ``Work`` is returned) is done when its future completes,
  observed by a callback, never by waiting;
- on CUDA, a pair of timing events on the current stream (the stream the collective is issued
  on), resolved on the agent's record thread (:meth:`CommTiming.resolve`); for an asynchronous
  ``Work`` the end event is recorded by the future's callback, which torch runs on streams that
  wait for the collective.

Usage from a strategy::

    rec = source.collectives
    out = rec.call("reduce_scatter", nbytes, fn, *args, **kwargs)   # times fn
    # or, around code that is not one call:
    t = rec.start(tensor); ...; rec.stop("all_reduce", t, nbytes)
    # or a duration measured elsewhere (seconds, on the host):
    rec.record("recv", seconds, nbytes)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..metrics import COLLECTIVE_OPS
from .comm_issue import IssueClock

__all__ = ["OPS", "CollectiveRecorder", "CommTiming", "tensor_bytes"]

OPS = COLLECTIVE_OPS
"""Every value of the ``op`` label, in exposition order. ``all_reduce``: DDP's gradient buckets,
HSDP's replicate-dim reduction, DeepSpeed's reductions; ``reduce_scatter`` / ``all_gather``:
FSDP2 and DeepSpeed ZeRO; ``reduce``: DeepSpeed ZeRO-1/2 reducing a bucket to its owner;
``broadcast``: DeepSpeed ZeRO-3's broadcasts; ``send`` / ``recv``: pipeline stages'
point-to-point traffic."""

_MAX_PER_STEP = 4096
"""Timings kept per step and recorder (bytes are always counted): a step that issues more (or a
loop that never completes a step) stays bounded."""


def tensor_bytes(tensor: Any) -> int:
    """Bytes of one tensor (0 for anything else)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    return 0


@dataclass(slots=True)
class CommTiming:
    """Collectives recorded during one step, not yet resolved (CUDA events are resolved on the
    record thread)."""

    seconds: list[tuple[str, float]] = field(default_factory=list)
    """``(op, wall seconds)`` pairs (CPU)."""
    events: list[tuple[str, Any, Any]] = field(default_factory=list)
    """``(op, start, end)`` CUDA timing events."""
    bytes: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    """Timings not kept because the step went over the per-step bound."""
    last_start: Any = None
    """The start event of the last collective issued (CUDA; ``agent.device_wait``)."""

    def resolve(self, on_error: Callable[[str, BaseException], None] | None = None
                ) -> dict[str, list[float]]:
        """``op -> [seconds, ...]``; CUDA events are read here (record thread: the step's
        values have reached the host, so its events have completed)."""
        out: dict[str, list[float]] = {}
        for op, seconds in self.seconds:
            out.setdefault(op, []).append(seconds)
        for op, start, end in self.events:
            try:
                out.setdefault(op, []).append(start.elapsed_time(end) / 1000.0)
            except Exception as exc:  # an event not recorded yet: that sample is lost
                if on_error is not None:
                    on_error("comm", exc)
        return out

    @property
    def count(self) -> int:
        return len(self.seconds) + len(self.events)


class CollectiveRecorder:
    """Thread-safe per-step log of collectives (hooks run on autograd and backend threads)."""

    def __init__(self, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self._on_error = on_error
        self._lock = threading.Lock()
        self._timing = CommTiming()
        self.enabled = True
        self.last_issue: float | None = None
        """``perf_counter`` when the last collective was issued (``agent.step_split``: the
        time after it, to the end of the backward, is time spent waiting for other ranks)."""
        self.issue = IssueClock()
        """Time inside the calls that issue this rank's collectives (``comm_issue``)."""

    # ------------------------------------------------------------------ timers
    def start(self, tensor: Any = None) -> Any:
        """A timer started now: a CUDA event on the current stream of ``tensor``'s device (of
        the current device when CUDA is initialised and no tensor is given), else a float. Its
        host time is kept as :attr:`last_issue`."""
        self.last_issue = now = time.perf_counter()
        device = tensor.device if isinstance(tensor, torch.Tensor) else None
        if device is not None and device.type == "cuda" or (
            device is None and torch.cuda.is_available() and torch.cuda.is_initialized()
        ):
            try:
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                self._timing.last_start = event
                return event
            except Exception:
                pass
        return now

    def stop(self, op: str, timer: Any, nbytes: int = 0) -> None:
        """The collective started by ``timer`` is complete now (CPU) / in stream order (CUDA)."""
        try:
            if isinstance(timer, float):
                self._add(op, nbytes, seconds=time.perf_counter() - timer)
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._add(op, nbytes, events=(timer, end))
        except Exception as exc:
            self.error(exc)

    def stop_at_completion(self, op: str, timer: Any, nbytes: int, work: Any) -> None:
        """Stop ``timer`` when the asynchronous ``work`` completes, seen by a callback on its
        future (no wait). Without a future, the issue time is all that is known: recorded now."""
        try:
            future = work.get_future()
        except Exception:
            self.stop(op, timer, nbytes)
            return

        def done(_fut: Any) -> None:
            self.stop(op, timer, nbytes)

        try:
            future.add_done_callback(done)
        except Exception as exc:
            self.error(exc)

    def call(self, op: str, nbytes: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
             ) -> Any:
        """``fn(*args, **kwargs)`` timed as one ``op``: to its return when it returns no
        ``Work`` (a synchronous collective), else to the work's completion. ``fn``'s own errors
        propagate untouched; the recorder's never do. Positional-only, so ``fn``'s keywords
        (``op=`` of a reduce-scatter) pass through."""
        if not self.enabled:
            return fn(*args, **kwargs)
        timer = None
        try:
            timer = self.start(_first_tensor(args, kwargs))
        except Exception as exc:
            self.error(exc)
        began = self.issue.begin()
        result = fn(*args, **kwargs)
        if _is_work(result):  # issued, not done: the call's time is this rank's own
            self.issue.end(began)
        if timer is not None:
            if _is_work(result):
                self.stop_at_completion(op, timer, nbytes, result)
            else:
                self.stop(op, timer, nbytes)
        return result

    def record(self, op: str, seconds: float, nbytes: int = 0) -> None:
        """A duration measured by the caller (host seconds)."""
        try:
            self._add(op, nbytes, seconds=float(seconds))
        except Exception as exc:
            self.error(exc)

    # ------------------------------------------------------------------ per step
    def take(self) -> CommTiming | None:
        """What was recorded since the last call (None: nothing)."""
        with self._lock:
            timing = self._timing
            if not timing.bytes and not timing.count:
                return None  # nothing this step (most steps of most strategies): no new object
            self._timing = CommTiming()
        return timing

    def _add(self, op: str, nbytes: int, seconds: float | None = None,
             events: tuple[Any, Any] | None = None) -> None:
        if op not in OPS:
            raise ValueError(f"collective op {op!r}: expected one of {OPS}")
        with self._lock:
            t = self._timing
            t.bytes[op] = t.bytes.get(op, 0) + int(nbytes)
            if t.count >= _MAX_PER_STEP:
                t.dropped += 1
            elif seconds is not None:
                t.seconds.append((op, seconds))
            elif events is not None:
                t.events.append((op, *events))

    def error(self, exc: BaseException) -> None:
        if self._on_error is not None:
            self._on_error("comm", exc)


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _is_work(value: Any) -> bool:
    return value is not None and callable(getattr(value, "get_future", None)) and callable(
        getattr(value, "wait", None)
    )
