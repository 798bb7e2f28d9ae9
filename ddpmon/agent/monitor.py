"""The ``Monitor`` that ``ddpmon.attach`` returns: builds the parts, starts them, closes them.

The parts, each in its own module: run context, gradient source (per strategy), step flow
and its markers, sinks (``record_sinks``), checkpoints, forensics files, the /metrics endpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import Config
from ..metrics.state import MetricState, possible_skippers
from ..metrics.step_metrics import chosen
from ..probes.amp import ScalerProbe
from ..probes.grads import ParamIndex
from ..recorder.annotations import check_fields, write_annotations
from ..strategies.attach_args import Plan
from ..strategies.base import EngineFloor, SourceEnv
from ..strategies.precision import read_precision
from ..strategies.registry import detect_strategy, make_source
from ..strategies.replicas import ReplicaCheck
from . import registry
from .activity import LoopPhases
from .checkpoints import (
    CheckpointObserver,
    CheckpointTimer,
    DcpCapture,
    NullTimer,
    detect_attempt,
    tag_attempt,
)
from .context import RunContext
from .drainer import RecordThread
from .endpoint import Endpoint
from .goodput_live import FiguresApi, start_figures
from .guard import Guard
from .host_facts import manifest_extra, start_fields, states_present
from .policy import NonFinitePolicy
from .record_sinks import RecordSinks
from .recording import Forensics
from .rerun import StepRerun, run_step
from .sinks import Sink
from .step_flow import StepFlow
from .step_markers import StepMarkers
from .update_wiring import SpikeParts


class Monitor(LoopPhases, FiguresApi):
    """One rank's agent. Create it with ``ddpmon.attach``."""

    enabled = True
    error = None

    def __init__(self, config: Config, state: MetricState, guard: Guard) -> None:
        self.config = config
        self._state = state
        self.guard = guard
        self.records: RecordThread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.user_sinks: tuple[Sink, ...] = ()  # attach(..., sinks=[...]), after ddpmon's

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        config: Config,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        plan: Plan | None = None,
        sinks: tuple[Sink, ...] = (),
    ) -> Monitor:
        state = MetricState(
            loss_scale_floor=config.loss_scale_floor, stall_threshold_seconds=config.stall_seconds
        )
        self = cls(config, state, Guard(state.count_error))
        self.user_sinks = sinks
        try:
            self._assemble(model, optimizer, scaler, comm_hook, comm_state, plan)
        except BaseException:
            self._abort()  # leave no hook, thread or server behind
            raise
        return self

    def _assemble(self, model, optimizer, scaler, comm_hook, comm_state, plan=None) -> None:
        """Build the parts in order: who this rank is, what measures, where records go..."""
        self._settle(model, optimizer, scaler, plan)
        self._measure(comm_hook, comm_state, plan)
        self._flow(self._sinks(), plan)
        self._observe_and_serve()

    def _settle(self, model, optimizer, scaler, plan) -> None:
        """Identity, run dir, parameter index, forensic files, attempt, the scaler probe."""
        config, state, guard = self.config, self._state, self.guard
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.ctx = ctx = RunContext.establish(model, config, guard)
        self.identity, self.run_id, self.run_path = ctx.identity, ctx.run_id, ctx.run_path
        # A plan may name groups one level deeper (a split model: stage<k> first)
        levels = plan.group_levels if plan is not None and config.group_depth > 0 else 0
        self.index = ParamIndex(model, config.group_depth + levels, config.max_groups)
        self.forensics = Forensics.open(ctx, config, guard)
        rank = ctx.identity.rank
        self.attempt = detect_attempt(ctx.run_dir.events(rank), ctx.run_dir.progress(rank))
        state.attempt = self.attempt.number
        emit = tag_attempt(self.forensics.emit(guard), self.attempt.number)
        self._emit = emit
        guard.writes.connect(rank=rank, run_path=ctx.run_path, emit=emit)
        self.amp = None
        if scaler is not None:
            self.amp = ScalerProbe(
                scaler, optimizer, on_update=self._on_scaler_update, on_error=guard.error
            )
            state.amp_enabled = self.amp.enabled()

    def _measure(self, comm_hook, comm_state, plan) -> None:
        """The gradient source of this strategy, installed."""
        config, state, guard = self.config, self._state, self.guard
        model = self.model
        env = SourceEnv(
            model=model,
            index=self.index,
            on_error=guard.error,
            local_norm_every=config.local_norm_every,
            data_check_interval=config.data_check_interval,
            comm_hook=comm_hook,
            comm_state=comm_state,
            amp=self.amp,
            defer_reduction_wait=config.on_nonfinite == "record",
        )
        if plan is not None:
            strategy = plan.strategy
            self.source = plan.make_source(env)
        else:
            strategy = detect_strategy(model)
            self.source = make_source(strategy, env)
        state.strategy = self.source.name if ":" not in strategy else strategy
        self.engine_facts = self.source.engine_facts
        if self.engine_facts is not None:
            state.amp_enabled = self.engine_facts.precision == "fp16"
        self.precision = read_precision(model, self.index.params, self.scaler, self.engine_facts,
                                        state, self.identity.device)
        engine = self.engine_facts is not None
        state.steps_skipped_total = dict.fromkeys(
            possible_skippers(engine, state.amp_enabled, config.on_nonfinite), 0
        )
        with guard("grads"):
            self.source.install()
            self.index.order.watch(self.index.params, guard.error)  # the origin's order

    def _sinks(self) -> list[Sink]:
        """Where records go (``record_sinks``)."""
        sinks = RecordSinks.assemble(
            ctx=self.ctx, config=self.config, state=self._state, guard=self.guard,
            emit=self._emit, forensics=self.forensics, attempt=self.attempt.number,
            index=self.index, scaler=self.scaler, source=self.source,
            manifest_extra=functools.partial(manifest_extra, self),
            summary_head=lambda: {"run_id": self.run_id, "rank": self.identity.rank,
                                  "port": self.port},
            last_checkpoint=lambda: self.checkpoints.last_save,
            flush=lambda: self.flow.drain(wait=True),
        )
        self.floor, self.incidents, self.manifest = sinks.floor, sinks.incidents, sinks.manifest
        return [*sinks.all, *self.user_sinks]

    def _flow(self, sinks: list[Sink], plan) -> None:
        """The step flow over the source and sinks, what marks its steps (hooks and the
        strategy's own markers), and the record thread."""
        config, guard, ctx, emit = self.config, self.guard, self.ctx, self._emit
        model, optimizer = self.model, self.optimizer
        policy = NonFinitePolicy(config.on_nonfinite, self.index, ctx.identity.rank, emit)
        self.flow = StepFlow(
            source=self.source,
            index=self.index,
            guard=guard,
            policy=policy,
            sinks=sinks,
            grad_norm_tolerance=config.grad_norm_tolerance,
            optimizer=optimizer,
            step_metrics=chosen(config.step_metrics), precision=self.precision,
        )
        if config.on_nonfinite == "rerun":
            self.flow.rerun = StepRerun.for_monitor(self, self._state, self._emit)
        with guard("comm"):
            scope, _ = self.source.replica_scope()
            self.flow.replicas = ReplicaCheck.of(scope, self.index, config.replica_check_every)
            if self.flow.replicas is not None:
                self._state.replica_mismatch_total = 0  # exported from 0, so increase() works
        self.forensics.follow(self.flow, self.incidents, emit, guard)
        self.spikes = SpikeParts.install(self, plan, self._state, emit)  # before markers
        self.markers = StepMarkers(
            model, optimizer, self.flow, self.source, amp=self.amp,
            on_error=guard.error, on_engine_step=self._on_engine_step,
            on_engine_floor=self._on_engine_floor,
        )
        self.records = RecordThread(lambda: self.flow.drain(wait=False)).start()
        self.flow.background = True

    def _observe_and_serve(self) -> None:
        """Checkpoints and DCP, the /metrics endpoint, the stall watchdog, the start event."""
        config, state, guard, ctx, emit = (self.config, self._state, self.guard, self.ctx,
                                           self._emit)
        self.checkpoints = CheckpointObserver(
            state, emit, guard, on_load=self._resume_at,
            present=functools.partial(states_present, self.optimizer, self.scaler),
            phase=self.flow.in_checkpoint,
        )
        self.dcp = DcpCapture(self.checkpoints, lambda: self.flow.step)
        with guard("checkpoint"):
            self.dcp.install()
        self.endpoint = Endpoint.open(
            state, ctx.identity, ctx.run_id, config, guard, catch_up=self.flush
        )
        self.exposition = self.endpoint.exposition
        self._serve_activity()
        self.port = self.endpoint.port
        self.goodput, self.throughput = start_figures(self, state)  # closed with the endpoint
        self.forensics.watch(
            config.stall_seconds,
            heartbeat=self.flow.heartbeat,
            on_stall=self._on_stall,
            guard=guard,
            flight_recorder=ctx.run_dir.flight_recorder(ctx.identity.rank),
        )
        atexit.register(self.close)
        registry.add(self)
        self.manifest.at_attach()  # before the start event: rank 0's start implies the file
        self._emit("start", None, **start_fields(self))

    # ------------------------------------------------------------------ public API
    @property
    def state(self) -> MetricState:
        """The metric state with every step whose values are on the host applied (catches up)."""
        self.flush()
        return self._state

    def flush(self) -> None:
        """Deliver every step whose values have arrived (on CPU: all completed steps, the
        other ranks' share of a step's small norm all-reduce waited for) to the metric state,
        events, progress and history now. Never waits for a device."""
        if not self._closed:
            self.flow.drain(wait=False, collectives=True)

    @property
    def strategy(self) -> str:
        """The strategy label of this rank (``ddpmon_rank_info{strategy}``)."""
        return self._state.strategy

    @property
    def step(self) -> int:
        """Number of steps completed so far (host counter, no sync)."""
        return self.flow.step

    def observe_loss(self, loss: Any) -> None:
        """Record this step's loss; a tensor is kept on its device, never read here. Under
        a strategy whose rank never sees the loss (``source.has_loss``) it is ignored."""
        if not self._closed and self.source.has_loss:
            self.flow.observe_loss(loss)

    def observe_samples(self, ids: Any) -> None:
        """This step's sample ids (a list, or a tensor on any device), kept by reference: read
        only for a rerun's event and evidence or a ``loss_spike`` event, never the samples."""
        if not self._closed:
            self.flow.observe_samples(ids)
            self.spikes.note_samples(self.flow.step, ids)

    def run_step(self, closure: Callable[[], Any]) -> Any:
        """Run the step's forward and backward (``closure``, returning the loss) and keep it in
        hand for ``on_nonfinite='rerun'``: the ``optimizer.step()`` or an engine's
        ``engine.step()`` that follows reruns it once when the step triggers. For loops whose
        optimizer takes no closure. Without the rerun policy it just calls ``closure()``."""
        if self._closed or self.flow.rerun is None:
            return closure()

        return run_step(self.flow, closure)

    def observe_grad_norm(self, value: Any, step: int | None = None) -> None:
        """The gradient norm your trainer computed for optimizer step ``step`` (default: the
        step in progress): a float or a device tensor, compared with ddpmon's own on the
        readback path (``ddpmon_grad_norm_mismatch_total``); never read here."""
        if not self._closed:
            self.flow.observe_grad_norm(value, step)

    def observe_checkpoint(
        self,
        step: int,
        path: Any,
        kind: str = "save",
        *,
        model: bool | None = None,
        optimizer: bool | None = None,
        scaler: bool | None = None,
        rng: bool | None = None,
        data_loader: bool | None = None,
        size: int | None = None,
    ) -> CheckpointTimer | NullTimer:
        """Time a checkpoint save or load: ``with mon.observe_checkpoint(step, path): save()``
        (or keep the returned timer and call ``.done()``). Non-blocking, reads no device value.

        ``step``: the step a resume from this checkpoint starts at (optimizer steps it holds).
        For ``kind="load"``, say what the resume restored (``optimizer=True, rng=False`` ...):
        the manifest records it and ddpmon names what was not restored; a load before the first
        step also makes ddpmon count steps from ``step``. ``size``: bytes, when the path does
        not tell (it is measured on disk otherwise). Bad arguments raise ``ValueError``."""
        if self._closed:
            return NullTimer()
        restored = {"model": model, "optimizer": optimizer, "scaler": scaler, "rng": rng,
                    "data_loader": data_loader}
        return self.checkpoints.timer(step, path, kind, restored, size)

    def annotate(self, **fields: Any) -> None:
        """Record run facts only the script knows (``global_batch``, ``micro_batch``,
        ``accumulation``, ``seed``, ...) in ``annotations.json`` (rank 0, atomic), where
        ``ddpmon compare`` reads them. Bad fields raise ``ValueError``; I/O errors are counted."""

        fields = check_fields(fields)
        if self.identity.rank == 0 and self.forensics.events is not None:
            with self.guard("forensics"):
                write_annotations(self.run_path, fields)

    def recent_steps(self) -> list:
        """The last (up to 64) step records, oldest first: plain host values."""
        self.flush()
        return list(self.incidents.recent)

    def owns(self, params: Sequence[torch.Tensor]) -> bool:
        return not self._closed and self.index.positions_of(params) is not None

    @property
    def collectives(self):
        """The recorder strategy code reports collectives to (``ddpmon.probes.comm``)."""
        return self.source.collectives

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the current gradients of ``params``, correct for this model's
        strategy (reusing norms already measured where possible): a device tensor."""
        return self.source.clip_norm(params)

    def close(self) -> None:
        """Flush pending readbacks, write the summary, stop the server. Idempotent.

        Before the server stops, the rank lingers until a store's scraper has taken the final
        values (``linger_seconds`` bounds it; see ``export/delivery.py`` for when it waits)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        registry.discard(self)
        if self.records is not None:
            self.records.stop()
        self.flow.background = False
        with self.guard("readback"):
            self.flow.drain(wait=True)
            self.flow.trainer_norms.flush()
        self.markers.close()  # the spike probes close with their sink (the spike detector)
        self.dcp.uninstall()
        self.source.close()
        self.forensics.close()
        self._emit("exit", self._state.step, reason="close", steps=self._state.steps_total)
        for sink in self.flow.sinks:
            with self.guard(sink.probe):
                sink.close()
        final_at = time.monotonic()  # every value is final: a scrape rendered now has them all
        try:
            with self.guard("server"):
                self.endpoint.linger(self.config.linger_seconds, final_at, self.identity.rank)
        finally:
            self.endpoint.close()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def _abort(self) -> None:
        """Undo a build that failed half-way: close whatever parts exist."""
        self._closed = True
        registry.discard(self)
        for name, method in (
            ("records", "stop"), ("markers", "close"), ("spikes", "close"), ("amp", "detach"),
            ("dcp", "uninstall"), ("source", "close"), ("forensics", "close"), ("endpoint", "close")
        ):
            close = getattr(getattr(self, name, None), method, None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ callbacks
    def _on_scaler_update(self, found: Any, before: Any, after: Any) -> None:
        if self._closed:
            return
        self.flow.scaler_updated(found, before, after)
        if self.floor.raises and after is not None:
            scale = None
            with self.guard("amp"):
                scale = float(after)  # on_loss_scale_floor=raise: the documented host read
            self.floor.after_step(self.flow.step - 1, scale)  # may raise, deliberately

    def _on_engine_step(self, facts: Any) -> None:
        """An engine that decides its own steps ended one (``StepHost.on_engine_step``)."""
        if self._closed:
            return
        if facts.engine_step and self.flow.step == 0:
            # the first step after attach: number it as the engine does (a load_checkpoint
            # before it restored the engine's count), whether attach came before or after
            self._resume_at(facts.engine_step)
        self.flow.complete(host_skipped=facts.skipped, host_scale_after=facts.scale_after)
        if self.floor.raises:
            self.floor.after_step(self.flow.step - 1, facts.scale_after)  # may raise

    def _on_engine_floor(self, floor: EngineFloor) -> None:
        """An engine's scaler raised at its minimum scale inside its step."""
        if not self._closed:
            self.floor.engine_floor(self.flow.step, floor)

    def _resume_at(self, step: int) -> None:
        """A checkpoint load before the first step: count steps from the resume step, so the
        resumed attempt's steps line up with the attempt it continues."""
        if self._state.steps_total == 0 and self.flow.resume_at(step):
            self._state.resume_at(step)

    def _on_stall(self, idle_seconds: float) -> None:
        step = self.flow.step
        self._emit(
            "stall",
            step,
            idle_seconds=round(idle_seconds, 3),
            stall_seconds=self.config.stall_seconds, **self._stall_fields(),
        )
        with self.guard("evidence"):
            self.incidents.write_evidence(
                "stall", step, None, idle_seconds=idle_seconds, last_step=self._state.step
            )
