"""Pipeline parallel probes: per-micro-batch NaN sites on each stage (forward/backward chunk
wrappers and a hook on each fresh output, never on the persistent receive buffers), the timing
of the stages' sends and receives, and the wrapper of ``schedule.step()`` that marks a step
(docs/parallelism.md, Pipeline parallel)."""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..._torch_compat import batch_p2p, set_batch_p2p
from ...host_reads import host_read_free
from ...metrics.step_slots import Slot
from ..base import StepExtension
from .setup import (
    PipelineSetup,
    StageInfo,
)

PARAM_GRAD_SEQ = 1.0e9
"""Sequence number of the parameter gradients: after every per-micro-batch event of a step."""
NO_EVENT = math.inf
_MAX_EVENTS = 1 << 14
"""Probe events kept between two collects (4 per micro-batch and stage in a normal step)."""


# ---------------------------------------------------------------------------------- probes
PP_NORM = Slot("pp_norm", 2, "pipeline parallel: squared norm summed over stages, failures")
PP_FLAGS = Slot("pp_flags", None, "pipeline parallel: per stage, first non-finite receipt/product")


@dataclass(slots=True)
class PPStep(StepExtension):
    """What one step's pipeline probes hand to the record (host table + device tensors): the
    step's ``StepExtension`` under pipeline parallel."""

    replaces_global_norm = True
    """A stage's reduced norms cover its own stages; the global norm is summed over all."""
    elsewhere = "another pipeline stage"

    source: Any
    norm: torch.Tensor
    """float64 [sum over stages of squared norms, failures]: identical on every pp rank."""
    flags: torch.Tensor
    """float64, 2 per local stage (``stages`` order)."""
    table: list[tuple[int, int, str]]
    """seq -> (stage, micro-batch, site)."""
    stages: list[int]

    def values(self) -> dict[str, torch.Tensor | None]:
        return {PP_NORM.name: self.norm,
                PP_FLAGS.name: self.flags if self.flags.numel() else None}

    def decision_norm(self) -> torch.Tensor:
        """The pp-summed squared norm: a skip/raise decision is the same on every stage."""
        return self.norm[:1]

    def global_norm(self, parts: dict[str, list[float]]) -> float | None:
        """The norm over every stage; None when some rank's measurement failed (and NaN or Inf
        as the sum has it)."""
        if PP_NORM.name not in parts:
            return None
        total, failures = parts[PP_NORM.name][0], parts[PP_NORM.name][1]
        if failures > 0:
            return None
        if not math.isfinite(total):
            return float("nan") if math.isnan(total) else float("inf")
        return math.sqrt(max(total, 0.0))

    def finish(self, record: Any, parts: dict[str, list[float]], local: tuple | None,
               reduced: tuple | None) -> None:
        self.source.origin.finish(record, parts, self, local, reduced)


class StageProbes:
    """Wraps each stage's ``forward_one_chunk``/``backward_one_chunk`` on the instance."""

    def __init__(self, setup: PipelineSetup, on_error) -> None:
        self.setup = setup
        self.on_error = on_error
        self._lock = threading.Lock()
        self._seq = 0
        self._table: list[tuple[int, int, str]] = []
        self._events: list[tuple[float, int, torch.Tensor]] = []
        self._stage_slot = {s.index: k for k, s in enumerate(setup.stages)}
        self._indices = [s.index for s in setup.stages]
        self.dropped = 0
        """Events not recorded because no step collected them (bounded memory)."""
        self._wrapped: list[tuple[Any, str]] = []
        self.enabled = True

    def install(self) -> None:
        for info in self.setup.stages:
            stage = info.stage
            self._wrap(stage, "forward_one_chunk", self._forward_wrapper(info))
            self._wrap(stage, "backward_one_chunk", self._backward_wrapper(info))

    def _wrap(self, stage: Any, name: str, make) -> None:
        original = getattr(stage, name)
        setattr(stage, name, make(original))
        self._wrapped.append((stage, name))

    def uninstall(self) -> None:
        self.enabled = False
        _unwrap_instances(self._wrapped)

    def _forward_wrapper(self, info: StageInfo):
        def make(original):
            def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
                out = original(fwd_chunk_id, *args, **kwargs)
                if self.enabled and torch.is_grad_enabled():
                    try:
                        self._after_forward(info, int(fwd_chunk_id))
                    except Exception as exc:
                        self.on_error("grads", exc)
                return out

            return forward_one_chunk

        return make

    def _backward_wrapper(self, info: StageInfo):
        def make(original):
            def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
                out = original(bwd_chunk_id, *args, **kwargs)
                if self.enabled and not info.is_first:
                    try:
                        sent = info.stage.bwd_cache.get(bwd_chunk_id, ())
                        self._event(info, int(bwd_chunk_id), "activation_grad", 1, _tensors(sent))
                    except Exception as exc:
                        self.on_error("grads", exc)
                return out

            return backward_one_chunk

        return make

    def _after_forward(self, info: StageInfo, mb: int) -> None:
        cached = info.stage.fwd_cache.get(mb)
        if cached is None:
            return
        outputs, inputs = cached
        if not info.is_first:
            self._event(info, mb, "received_activation", 0, _tensors(inputs))
        site = "output" if info.is_last else "activation"
        outs = _tensors(outputs)
        self._event(info, mb, site, 1, outs)
        if not info.is_last:
            for t in outs:
                if t.requires_grad:  # a fresh tensor per micro-batch: hooks cannot pile up
                    t.register_hook(self._grad_hook(info, mb))

    def _grad_hook(self, info: StageInfo, mb: int):
        def received(grad: torch.Tensor) -> None:
            if self.enabled:
                try:
                    self._event(info, mb, "received_activation_grad", 0, [grad])
                except Exception as exc:
                    self.on_error("grads", exc)

        return received

    def _event(
        self, info: StageInfo, mb: int, site: str, slot: int, tensors: list[torch.Tensor]
    ) -> None:
        """``slot`` 0: received, 1: produced. Two device ops per tensor (:func:`_all_finite`),
        nothing read on an accelerator (on CPU, where a read is free, one float32 sum read);
        the flags are combined once per step in ``take``."""
        if not tensors:
            return
        with torch.no_grad():
            finite = [_all_finite(t.detach()) for t in tensors]
            with self._lock:
                if len(self._events) >= _MAX_EVENTS:  # no collect for a long time: stay bounded
                    self.dropped += 1
                    return
                seq = self._seq
                self._seq += 1
                self._table.append((info.index, mb, site))
                position = 2 * self._stage_slot[info.index] + slot
                for ok in finite:
                    self._events.append((float(seq), position, ok))

    def take(self) -> tuple[torch.Tensor, list[tuple[int, int, str]], list[int]]:
        """Per local stage [first non-finite receipt, first non-finite product] (sequence
        numbers, ``inf``: none), as one device vector built with a handful of ops."""
        with self._lock:
            events, self._events = self._events, []
            table, self._table = self._table, []
            self._seq = 0
        width = 2 * len(self.setup.stages)
        if not events:
            return torch.full((width,), NO_EVENT, dtype=torch.float64), table, self._indices
        device = events[0][2].device
        finite = torch.stack([e[2].to(device) for e in events])
        seqs = _to_device(torch.tensor([e[0] for e in events], dtype=torch.float64), device)
        where = _to_device(torch.tensor([e[1] for e in events], dtype=torch.long), device)
        values = torch.where(finite, torch.full_like(seqs, NO_EVENT), seqs)
        out = torch.full((width,), NO_EVENT, dtype=torch.float64, device=device)
        return out.scatter_reduce(0, where, values, "amin"), table, self._indices


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``t``'s device: no NaN or Inf in ``t``. Below float64, the float64 sum of its
    elements: a NaN or Inf anywhere makes it non-finite and finite elements cannot overflow it
    (16-bit and float32 values times any tensor size stay far below float64's range); one
    reduction, ~4x cheaper on CPU than ``isfinite(t).all()``, which float64 tensors keep.

    Where a host read is free (CPU), a float32 sum is read first, 4.6x cheaper than the float64
    one: a finite sum proves every element finite; only a non-finite one (a NaN or Inf, or
    finite values whose float32 sum overflowed) takes the float64 sum."""
    if t.dtype.itemsize < 8 and t.is_floating_point():
        if host_read_free(t.device) and math.isfinite(float(t.sum(dtype=torch.float32))):
            return _FINITE
        return torch.isfinite(t.sum(dtype=torch.float64))
    return torch.isfinite(t).all()


_FINITE = torch.ones((), dtype=torch.bool)
"""The CPU answer of a finite check that a float32 sum settled (shared, never written)."""


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a sync: pinned and non-blocking on CUDA (a
    pageable or blocking copy would wait for the stream)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    """Floating tensors one container level deep."""
    if isinstance(value, torch.Tensor):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        return []
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


class P2PTiming:
    """Send/recv time of this rank's stages: ``send`` and ``recv`` in the collective family.

    The stages' ``get_{fwd,bwd}_{send,recv}_ops`` (wrapped on the instance) mark the
    ``P2POp`` objects they return as ours; ``schedules._batch_p2p``, through which every
    schedule issues them, is wrapped once per process while a pipeline monitor is attached (a
    module attribute: torch's schedules look it up at each call) and times marked ops from issue
    to their ``Work``'s completion (a future callback, never a wait). ``dist.isend``/``irecv``
    themselves are never patched: ``P2POp`` checks ``op`` by identity."""

    def __init__(self, setup: PipelineSetup, recorder: Any, on_error) -> None:
        self.setup = setup
        self.recorder = recorder
        self.on_error = on_error
        self._wrapped: list[tuple[Any, str]] = []
        self._installed = False

    def install(self) -> None:
        try:
            batch = batch_p2p()  # a private torch function: without it, no send/recv times
        except ImportError:  # pragma: no cover - torch without pipelining
            return
        if not callable(batch):
            return
        for info in self.setup.stages:
            for name in _P2P_METHODS:
                get_ops = getattr(info.stage, name, None)
                if get_ops is None:
                    continue
                setattr(info.stage, name, self._marking(get_ops))
                self._wrapped.append((info.stage, name))
        with _PATCH.lock:
            if _PATCH.users == 0:
                _PATCH.owner = weakref.WeakKeyDictionary()
                _PATCH.original = batch
                set_batch_p2p(_timed_batch_p2p)
            _PATCH.users += 1
        self._installed = True

    def _marking(self, original):
        def get_ops(chunk_id, *args, **kwargs):
            ops = original(chunk_id, *args, **kwargs)
            try:
                table = _PATCH.owner
                if table is not None:
                    for op in ops:
                        table[op] = self.recorder
            except Exception as exc:
                self.on_error("comm", exc)
            return ops

        return get_ops

    def uninstall(self) -> None:
        _unwrap_instances(self._wrapped)
        if not self._installed:
            return
        self._installed = False
        with _PATCH.lock:
            _PATCH.users -= 1
            if _PATCH.users == 0:
                try:
                    if batch_p2p() is _timed_batch_p2p:
                        set_batch_p2p(_PATCH.original)
                except Exception:
                    pass
                _PATCH.owner = None


class _BatchP2PPatch:
    """The process-wide state of the ``_batch_p2p`` wrapper: one wrapper while any pipeline
    monitor is attached (``users``), the function it wraps, and which ``P2POp`` is whose."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.original: Any = None
        self.owner: Any = None
        """``WeakKeyDictionary``: ``P2POp`` -> the ``CollectiveRecorder`` of its stage."""


_PATCH = _BatchP2PPatch()

_P2P_METHODS = ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops")


def _timed_batch_p2p(p2p_ops, *args, **kwargs):
    """``schedules._batch_p2p`` with ddpmon's P2P ops timed (others pass through untouched)."""
    original, table = _PATCH.original, _PATCH.owner
    marked = []
    try:
        if table is not None:
            marked = [(op, table.get(op)) for op in p2p_ops]
            marked = [(op, rec, rec.start(op.tensor)) for op, rec in marked if rec is not None]
    except Exception:
        marked = []
    works = original(p2p_ops, *args, **kwargs)
    if marked:
        try:
            by_op = dict(zip(map(id, p2p_ops), works, strict=False))
            last = works[-1] if works else None
            for op, rec, timer in marked:
                work = by_op.get(id(op), last) if len(works) == len(p2p_ops) else last
                kind = "send" if op.op is dist.isend else "recv"
                nbytes = op.tensor.numel() * op.tensor.element_size()
                if work is None:
                    rec.stop(kind, timer, nbytes)
                else:
                    rec.stop_at_completion(kind, timer, nbytes, work)
        except Exception as exc:
            rec_error = marked[0][1]
            rec_error.error(exc)
    return works


class ScheduleStep:
    """``schedule.step`` wrapped on the instance: one call is the step's forward and backward."""

    def __init__(self, setup: PipelineSetup, flow: Any, on_error) -> None:
        self.setup = setup
        self.flow = flow
        self.on_error = on_error
        self.closed = False

    def install(self) -> None:
        schedule = self.setup.schedule
        original = schedule.step
        self._previous = vars(schedule).get("step")  # an instance attribute of its own, if any

        def step(*args: Any, **kwargs: Any) -> Any:
            training = torch.is_grad_enabled() and not self.closed
            if training:
                try:
                    self.flow.forward_started(args)
                except Exception as exc:
                    self.on_error("step", exc)
            out = original(*args, **kwargs)
            if training:
                self.flow.backward_ended()
            return out

        step.__wrapped__ = original  # type: ignore[attr-defined]
        schedule.step = step
        self._step = step

    def close(self) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        self.closed = True
        schedule = self.setup.schedule
        try:
            if vars(schedule).get("step") is getattr(self, "_step", None):
                if self._previous is not None:
                    schedule.step = self._previous
                else:
                    del schedule.step
        except Exception:
            pass


def _unwrap_instances(wrapped: list[tuple[Any, str]]) -> None:
    """Undo wrappers set as instance attributes (the class's method shows through again);
    best effort at close, and the list is emptied."""
    for obj, name in wrapped:
        try:
            if name in vars(obj):
                delattr(obj, name)
        except Exception:
            pass
    wrapped.clear()
