"""Pipeline parallel (``torch.distributed.pipelining``), alone or composed with FSDP2 or DDP.

``attach(model_parts, optimizer, schedule=schedule)``: ``model_parts`` are the stage modules
this rank holds (two for interleaved and V schedules). Why each piece looks the way it does
(docs/parallelism.md, Pipeline parallel; verified facts in the project's pipeline notes):

- A step is one ``schedule.step()`` (wrapped on the instance, undone at close) followed by one
  ``optimizer.step()``. Module hooks fire per micro-batch plus a hidden metadata pass on the
  first step, so none of them marks a step: ddpmon's view of the stages (``PipelineParts``) is
  never called, and the end of ``schedule.step()`` is the end of backward. Gradients are final
  only then (``scale_grads`` and FSDP2's reduce-scatter run in the schedule's last action).
- Names carry the stage (``stage1.layers.0.fc1.weight``): a ``ModuleList`` split renumbers
  layers, so FQNs alone collide across stages.
- Norms: each stage holds only its own parameters, so the global norm is
  ``sqrt(sum over stages of the stage's squared norm)``; the stage's squared norm (after the
  shard reduction under FSDP2) is summed with one 2-number all-reduce over the pp group, issued
  on every rank at every collect, failures included (a failure flag, never a NaN). Group and
  local norms stay per stage.
- NaN origin: a stage is the origin when its weights entering the step were finite and the
  first non-finite thing it touched was something it *produced* (an activation it sent, its
  output, an activation gradient it sent, a parameter gradient), not something it *received*.
  Order comes from a host sequence number per probe; on the device each stage keeps only
  ``min(seq)`` of the first bad receipt and the first bad product (no host read). Probes wrap
  the stage's ``forward_one_chunk``/``backward_one_chunk`` (so the metadata pass is not seen)
  and hook each micro-batch's fresh output tensor (never the persistent receive buffers, whose
  hooks would pile up).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..probes.grads import NormVector, full_pass, unwrap_model
from .base import GradientSource, GradSummaries, SourceEnv

log = logging.getLogger("ddpmon")

SCALER_REFUSED = (
    "a GradScaler is not supported under pipeline parallel: only the last stage sees the loss, "
    "so scaler.step() raises 'Attempted step but _scale is None' on the other stages, and "
    "found_inf is not reduced over the pp group (stages skip different steps). Train in fp32 "
    "or bf16 (autocast, or FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16)) without a "
    "scaler, and attach without one"
)
TESTED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")
_END = 1.0e9
"""Sequence number of the parameter gradients: after every per-micro-batch event of a step."""
_NO_EVENT = math.inf
_MAX_EVENTS = 1 << 14
"""Probe events kept between two collects (4 per micro-batch and stage in a normal step)."""


class PipelineSetupError(ValueError):
    """``attach(..., schedule=)`` arguments ddpmon cannot monitor; the message says why."""


@dataclass(slots=True)
class StageInfo:
    index: int
    """The stage index (``PipelineStage.stage_index``)."""
    stage: Any
    module: torch.nn.Module
    """The stage's module as the schedule runs it (DDP- or FSDP2-wrapped)."""
    is_first: bool
    is_last: bool

    @property
    def prefix(self) -> str:
        return f"stage{self.index}"


class PipelineParts(torch.nn.Module):
    """ddpmon's view of this rank's stages: ``stage<k>`` children, so parameter names carry the
    stage. Never called (its hooks therefore never fire per micro-batch)."""

    def __init__(self, stages: Sequence[StageInfo]) -> None:
        super().__init__()
        for info in stages:
            self.add_module(info.prefix, unwrap_model(info.module))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ddpmon.PipelineParts is a view of the stages, not a model to call")


def _schedule_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else []
    return list(stages)


class PipelineSetup:
    """The stages of this rank, their process group and the schedule's facts, checked once."""

    def __init__(self, model_parts: Any, schedule: Any, scaler: Any = None) -> None:
        if scaler is not None:
            raise PipelineSetupError(SCALER_REFUSED)
        parts = list(model_parts) if isinstance(model_parts, (list, tuple)) else [model_parts]
        if not parts:
            raise PipelineSetupError("attach(model_parts, ..., schedule=): model_parts is empty")
        stages = _schedule_stages(schedule)
        if not stages or not hasattr(schedule, "step"):
            raise PipelineSetupError(
                f"attach(..., schedule=): {type(schedule).__name__} holds no PipelineStage; "
                "pass the torch.distributed.pipelining schedule this rank runs"
            )
        if getattr(vars(schedule).get("step"), "__wrapped__", None) is not None:
            raise PipelineSetupError(
                "ddpmon is already attached to this schedule; close the first monitor before "
                "attaching again"
            )
        by_module = {id(s.submod): s for s in stages}

        by_stage = {id(s): s for s in stages}
        found: list[StageInfo] = []
        for i, part in enumerate(parts):
            stage = by_stage.get(id(part)) or by_module.get(id(part))
            if stage is None:
                raise PipelineSetupError(
                    f"attach(model_parts, ..., schedule=): model_parts[{i}] "
                    f"({type(part).__name__}) is not the module of any PipelineStage of this "
                    "schedule; pass the modules given to PipelineStage (stage.submod)"
                )
            found.append(
                StageInfo(
                    index=int(stage.stage_index),
                    stage=stage,
                    module=stage.submod,
                    is_first=bool(stage.is_first),
                    is_last=bool(stage.is_last),
                )
            )
        missing = [s.stage_index for s in stages if all(f.stage is not s for f in found)]
        if missing:
            raise PipelineSetupError(
                f"attach(model_parts, ..., schedule=): the schedule runs stage(s) {missing} on "
                "this rank but model_parts does not hold them; pass every stage module of "
                "this rank"
            )
        found.sort(key=lambda f: f.index)
        self.schedule = schedule
        self.stages = found
        self.group = found[0].stage.group
        self.n_microbatches = int(getattr(schedule, "_n_microbatches", 1) or 1)
        self.scale_grads = bool(getattr(schedule, "scale_grads", True))
        self.container = PipelineParts(found)
        self.inner = self._inner_kind()
        self.strategy = "pp" if self.inner == "plain" else f"pp+{self.inner}"
        name = type(schedule).__name__
        if name not in TESTED_SCHEDULES:
            log.warning(
                "ddpmon: %s is not among the tested schedules (%s); its numbers are measured "
                "the same way but were not checked against torchtitan",
                name,
                ", ".join(TESTED_SCHEDULES),
            )

    def _inner_kind(self) -> str:
        ddp = torch.nn.parallel.DistributedDataParallel
        if any(isinstance(s.module, ddp) for s in self.stages):
            return "ddp"
        from .kinds import detect_sharded

        kind = detect_sharded(self.container)
        if kind is not None and kind.startswith("unsupported:"):
            raise PipelineSetupError(f"pipeline stages wrapped in {kind.split(':', 1)[1]}")
        return kind or "plain"

    @property
    def has_loss(self) -> bool:
        """The loss exists on the last stage only."""
        return any(s.is_last for s in self.stages)


# ---------------------------------------------------------------------------------- probes
@dataclass(slots=True)
class PPStep:
    """What one step's pipeline probes hand to the record (host table + device tensors)."""

    source: Any
    norm: torch.Tensor
    """float64 [sum over stages of squared norms, failures]: identical on every pp rank."""
    flags: torch.Tensor
    """float64, 2 per local stage (``stages`` order)."""
    table: list[tuple[int, int, str]]
    """seq -> (stage, micro-batch, site)."""
    stages: list[int]


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
        for stage, name in self._wrapped:
            try:
                if name in vars(stage):
                    delattr(stage, name)
            except Exception:
                pass
        self._wrapped.clear()

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
        """``slot`` 0: received, 1: produced. Two device ops per tensor (``isfinite().all()``),
        nothing read; the flags are combined once per step in ``take``."""
        if not tensors:
            return
        with torch.no_grad():
            finite = [torch.isfinite(t.detach()).all() for t in tensors]
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
            return torch.full((width,), _NO_EVENT, dtype=torch.float64), table, self._indices
        device = events[0][2].device
        finite = torch.stack([e[2].to(device) for e in events])
        seqs = _to_device(torch.tensor([e[0] for e in events], dtype=torch.float64), device)
        where = _to_device(torch.tensor([e[1] for e in events], dtype=torch.long), device)
        values = torch.where(finite, torch.full_like(seqs, _NO_EVENT), seqs)
        out = torch.full((width,), _NO_EVENT, dtype=torch.float64, device=device)
        return out.scatter_reduce(0, where, values, "amin"), table, self._indices


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

    _lock = threading.Lock()
    _users = 0
    _original: Any = None
    _owner: Any = None
    """``WeakKeyDictionary``: ``P2POp`` -> the ``CollectiveRecorder`` of the stage that made it."""

    def __init__(self, setup: PipelineSetup, recorder: Any, on_error) -> None:
        self.setup = setup
        self.recorder = recorder
        self.on_error = on_error
        self._wrapped: list[tuple[Any, str]] = []
        self._installed = False

    def install(self) -> None:
        try:
            from torch.distributed.pipelining import schedules
        except ImportError:  # pragma: no cover - torch without pipelining
            return
        for info in self.setup.stages:
            for name in _P2P_METHODS:
                original = getattr(info.stage, name, None)
                if original is None:
                    continue
                setattr(info.stage, name, self._marking(original))
                self._wrapped.append((info.stage, name))
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                import weakref

                cls._owner = weakref.WeakKeyDictionary()
                cls._original = schedules._batch_p2p
                schedules._batch_p2p = _timed_batch_p2p
            cls._users += 1
        self._installed = True

    def _marking(self, original):
        owner = type(self)

        def get_ops(chunk_id, *args, **kwargs):
            ops = original(chunk_id, *args, **kwargs)
            try:
                table = owner._owner
                if table is not None:
                    for op in ops:
                        table[op] = self.recorder
            except Exception as exc:
                self.on_error("comm", exc)
            return ops

        return get_ops

    def uninstall(self) -> None:
        for stage, name in self._wrapped:
            try:
                if name in vars(stage):
                    delattr(stage, name)
            except Exception:
                pass
        self._wrapped.clear()
        if not self._installed:
            return
        self._installed = False
        cls = type(self)
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                try:
                    from torch.distributed.pipelining import schedules

                    if schedules._batch_p2p is _timed_batch_p2p:
                        schedules._batch_p2p = cls._original
                except Exception:
                    pass
                cls._owner = None


_P2P_METHODS = ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops")


def _timed_batch_p2p(p2p_ops, *args, **kwargs):
    """``schedules._batch_p2p`` with ddpmon's P2P ops timed (others pass through untouched)."""
    original, table = P2PTiming._original, P2PTiming._owner
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
            rec_error._error(exc)
    return works


class ScheduleStep:
    """``schedule.step`` wrapped on the instance: one call is the step's forward and backward."""

    def __init__(self, setup: PipelineSetup, pipeline: Any, on_error) -> None:
        self.setup = setup
        self.pipeline = pipeline
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
                    self.pipeline.forward_started(args)
                except Exception as exc:
                    self.on_error("step", exc)
            out = original(*args, **kwargs)
            if training:
                self.pipeline.backward_ended()
            return out

        step.__wrapped__ = original  # type: ignore[attr-defined]
        schedule.step = step
        self._step = step

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


# ---------------------------------------------------------------------------------- source
class PipelineSource(GradientSource):
    """Per-stage numbers from the inner strategy (plain, FSDP2, DDP), one pp all-reduce for the
    global norm, and the per-stage origin."""

    name = "pp"

    def __init__(self, env: SourceEnv, setup: PipelineSetup) -> None:
        super().__init__(env)
        self.setup = setup
        self.name = setup.strategy  # type: ignore[misc]
        self.inner: GradientSource | None = None
        self.probes = StageProbes(setup, env.on_error)
        self.p2p = P2PTiming(setup, self.collectives, env.on_error)
        self._ddp_probes: list[Any] = []
        self._reduced: NormVector | None = None
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._stage_of = self._stage_positions()
        self._poisoned: set[int] = set()
        self.has_loss = setup.has_loss

    def _stage_positions(self) -> list[int]:
        """Stage index of each ``ParamIndex`` position (names start with ``stage<k>.``)."""
        out = []
        for name in self.index.names:
            head = name.split(".", 1)[0]
            out.append(int(head[5:]) if head.startswith("stage") and head[5:].isdigit() else -1)
        return out

    # ------------------------------------------------------------------ install / close
    def install(self) -> None:
        kind = self.setup.inner
        if kind == "ddp":
            from .ddp import CommProbe

            for info in self.setup.stages:
                module = info.module
                if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
                    continue
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    allreduce_hook,
                )

                probe = CommProbe(
                    self.index,
                    # the stage's DDP reduces over the dp group, not the default (world) group
                    inner_hook=allreduce_hook,
                    inner_state=module.process_group,
                    on_error=self.env.on_error,
                    data_check_interval=0,
                    local_norm_every=self.env.local_norm_every,
                    grads_are_bucket_views=bool(getattr(module, "gradient_as_bucket_view", False)),
                    collectives=self.collectives,
                )
                try:
                    module.register_comm_hook(None, probe.hook)
                    self._ddp_probes.append(probe)
                except Exception as exc:
                    log.warning("ddpmon: could not register its DDP comm hook on a stage (%s)", exc)
                    self.env.on_error("comm", exc)
        elif kind != "plain":
            from .detect import SOURCES, make_source

            if kind in SOURCES:
                self.inner = make_source(kind, self.env)
                self.inner.collectives = self.collectives  # one recorder: the pipeline takes ours
                self.inner.install()
        self.probes.install()
        self.p2p.install()

    def close(self) -> None:
        self.probes.uninstall()
        self.p2p.uninstall()
        try:
            self._wait_pending()
        except Exception:
            pass
        if self.inner is not None:
            self.inner.close()
        super().close()

    # ------------------------------------------------------------------ measurement
    def on_backward_end(self) -> None:
        """After ``schedule.step()``: every stage's gradients are final (reduced, scaled). The
        stage's squared norm is measured here and its pp all-reduce started (async), waited on
        at ``collect``. Every rank runs the same ``schedule.step()`` calls, so the collectives
        match; the all-reduce is issued whatever happened before it."""
        self._wait_pending()  # an earlier schedule.step() of the same optimizer step
        vec = None
        try:
            if self.inner is not None:
                self.inner.on_backward_end()
                vec = self._inner_squares()
            else:
                self._reduced = None
                self._reduced = full_pass(self.index, scaled=False)
        except Exception as exc:
            self.env.on_error("grads", exc)
            vec = self._failed_vector()
        if vec is None:
            vec = self._squares(self._reduced, 0.0)
        if vec is not None:
            work = dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.setup.group, async_op=True)
            self._pending = (vec, work)

    def _inner_squares(self) -> torch.Tensor | None:
        """[stage squared norm, failures] from the sharded source's own reduction (waited on
        here: the pp sum has to follow the shard sum), or None when it has none."""
        norms = getattr(self.inner, "_norms", None)
        pending = getattr(norms, "_pending", None)
        if pending is None:
            return None
        norms.wait()
        n = len(self.index)
        return torch.stack([pending.vector[:n].sum(), (pending.vector[n] > 0).to(torch.float64)])

    def _wait_pending(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        vec, work = pending
        work.wait()  # a stream wait on NCCL, no host sync
        return vec

    def collect(self) -> GradSummaries:
        out = GradSummaries()
        failed = 0.0
        try:
            out = self._collect_inner()
        except Exception as exc:
            failed = 1.0
            self.env.on_error("grads", exc)
        try:
            # Waited on here, as the sharded sources wait on theirs: the step's values must be
            # final when it is delivered (on CPU, flush() delivers every completed step).
            norm = self._wait_pending()
        except Exception as exc:  # the collective itself failed: not ours to hide, but counted
            self.env.on_error("grads", exc)
            norm = self._failed_vector()
        if norm is None:  # no schedule.step() end seen since the last step: measure now
            vec = self._squares(out.reduced, failed) if out.reduced is not None else None
            norm = vec if vec is not None else self._failed_vector()
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=self.setup.group)
        try:
            flags, table, stages = self.probes.take()
        except Exception as exc:
            self.env.on_error("grads", exc)
            flags, table, stages = torch.zeros(0, dtype=torch.float64), [], []
        out.pp = PPStep(self, norm, flags, table, stages)
        return out

    def _collect_inner(self) -> GradSummaries:
        setup = self.setup
        unscale = 1.0 / setup.n_microbatches if setup.scale_grads else 1.0
        if self.inner is not None:
            out = self.inner.collect()
            # FSDP2's reduce-scatter input is the sum over micro-batches, before scale_grads
            out.local = _scaled(out.local, unscale)
            return out
        reduced, self._reduced = self._reduced, None
        if reduced is None:
            reduced = full_pass(self.index, scaled=False)
        if setup.inner == "plain":
            return GradSummaries(reduced=reduced, local_is_reduced=True)
        out = GradSummaries(reduced=reduced)
        parts = [p.take() for p in self._ddp_probes]
        local_norms = [n for p in parts for n in p.local_norms]
        if local_norms:
            positions = [i for p in parts for i in p.local_positions]
            # DDP's bucket is the local sum over micro-batches, before scale_grads
            out.local = _scaled(NormVector(torch.cat(local_norms), positions), unscale)
            out.local_complete = all(p.local_buckets == p.buckets for p in parts)
        return out

    def _squares(self, reduced: NormVector | None, failed: float) -> torch.Tensor | None:
        """[sum of this rank's squared per-parameter norms, failures] (float64, device)."""
        if reduced is None:
            return None
        try:
            wide = reduced.norms.to(torch.float64)
            sq = (wide * wide).sum()
            return torch.stack([sq, torch.full_like(sq, failed)])
        except Exception as exc:
            self.env.on_error("grads", exc)
            return self._failed_vector()

    def _failed_vector(self) -> torch.Tensor:
        """Zero squares and one failure: every pp rank then reports no norm for the step."""
        device = torch.device("cpu")
        for p in self.index.params[:1]:
            device = p.device if p.device.type != "meta" else device
        return torch.tensor([0.0, 1.0], dtype=torch.float64, device=device)

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global norm over every stage: this rank's (sharded-aware) norm, squared, summed
        over the pp group. Every rank must clip (it is a collective), as torchtitan does."""
        if self.inner is not None:
            inner = self.inner.clip_norm(params)
        else:
            inner = super().clip_norm(params)
        sq = (inner.to(torch.float64) ** 2).reshape(1)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.setup.group)
        return sq.sqrt().reshape(())

    # ------------------------------------------------------------------ readback (host)
    def finish_record(self, record: Any, parts: dict, step: PPStep, local, reduced) -> None:
        """Global norm from the pp sum; origin per stage (see the module doc). Record thread.
        ``local``/``reduced``: (host values, positions) or None."""
        if "pp_norm" in parts:
            total, failures = parts["pp_norm"][0], parts["pp_norm"][1]
            record.grad_norm = None if failures > 0 else math.sqrt(max(total, 0.0))
            if failures == 0 and not math.isfinite(total):
                record.grad_norm = float("nan") if math.isnan(total) else float("inf")
            if record.grad_norm is not None and not math.isfinite(record.grad_norm):
                record.grad_nonfinite = True
        flags = parts.get("pp_flags", [])
        stage_bad_local = self._bad_stages(local)
        stage_bad_reduced = self._bad_stages(reduced)
        origin_where = None
        touched = False
        poisoned = False
        for k, index in enumerate(step.stages):
            recv = flags[2 * k] if 2 * k < len(flags) else _NO_EVENT
            prod = flags[2 * k + 1] if 2 * k + 1 < len(flags) else _NO_EVENT
            bad_param = stage_bad_local.get(index)
            if bad_param is not None:
                prod = min(prod, _END)
            if prod == _NO_EVENT and recv == _NO_EVENT:
                continue
            touched = True
            if index in self._poisoned:
                poisoned = True
                continue
            if prod < recv and origin_where is None:
                if prod >= _END:
                    where = {"stage": index, "microbatch": None, "site": "param_grad"}
                else:
                    _, mb, site = step.table[int(prod)]
                    where = {"stage": index, "microbatch": mb, "site": site}
                origin_where = where | {"param": bad_param}
        if (record.grad_nonfinite or stage_bad_reduced) and record.skipped_by is None:
            # An applied step with a non-finite global norm: every stage's weights are suspect
            # from now on (clipping by that norm, as torchtitan does, multiplies every stage's
            # gradients by NaN), so no later step can be an origin, as under DDP.
            self._poisoned.update(step.stages)
        record.pp_origin = origin_where
        record.origin = origin_where is not None
        record.poisoned = touched and not record.origin and poisoned
        record.origin_decided = True
        if touched:
            record.local_nonfinite = True
            if origin_where is not None:
                record.local_nonfinite_param = origin_where["param"] or (
                    f"stage{origin_where['stage']}.<{origin_where['site']}>"
                )
            elif record.local_nonfinite_param is None:
                record.local_nonfinite_param = next(
                    (p for p in stage_bad_local.values() if p), None
                )
            record.local_nonfinite_kind = record.local_nonfinite_kind or "nan"

    def _bad_stages(self, host) -> dict[int, str | None]:
        """Stage -> first non-finite parameter name, from (host values, positions)."""
        out: dict[int, str | None] = {}
        if host is None:
            return out
        values, positions = host
        bad = sorted(p for v, p in zip(values, positions, strict=True) if not math.isfinite(v))
        for pos in bad:
            stage = self._stage_of[pos] if 0 <= pos < len(self._stage_of) else -1
            if stage not in out:
                out[stage] = self.index.name(pos)
        return out

    def reset(self) -> None:
        self._poisoned.clear()


def _scaled(vector: NormVector | None, factor: float) -> NormVector | None:
    if vector is None or factor == 1.0:
        return vector
    return NormVector(vector.norms * factor, vector.positions, vector.scaled)


__all__ = [
    "SCALER_REFUSED",
    "PipelineParts",
    "PipelineSetup",
    "PipelineSetupError",
    "PipelineSource",
    "ScheduleStep",
]
