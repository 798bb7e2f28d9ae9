"""Where a rank's step records go, assembled once at attach: metrics, incidents (events,
evidence, and the loss-scale floor policy decided per record), progress, summary, manifest,
and history where the run dir is writable. ``all`` is the order of delivery."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..metrics.state import MetricState
from ..metrics.step_metrics import chosen
from ..probes.grads import ParamIndex
from ..recorder.history import HistorySink
from ..rundir.atomic import write_json_atomic
from .checkpoints import tag_evidence
from .context import RunContext
from .floor import FloorPolicy
from .guard import Guard
from .host_facts import scaler_state
from .recording import Forensics, manifest_writer
from .sinks import IncidentSink, ManifestSink, MetricSink, ProgressSink, SummarySink


@dataclass(slots=True)
class RecordSinks:
    all: list[Any]
    incidents: IncidentSink
    floor: FloorPolicy
    manifest: ManifestSink

    @classmethod
    def assemble(
        cls,
        *,
        ctx: RunContext,
        config: Config,
        state: MetricState,
        guard: Guard,
        emit: Callable[..., None],
        forensics: Forensics,
        attempt: int,
        index: ParamIndex,
        scaler: Any,
        manifest_extra: Callable[[], dict],
        summary_head: Callable[[], dict],
        last_checkpoint: Callable[[], Any],
        flush: Callable[[], None],
        source: Any = None,
    ) -> RecordSinks:
        """``summary_head``: the summary's identity fields (the port is known only later);
        ``last_checkpoint`` and ``flush``: for the floor policy's ``checkpoint`` mode."""
        rank = ctx.identity.rank
        stage = source.stage_label() if source is not None else None
        state.stage = stage or ""  # its step parts' label: straggler rules compare within it
        incidents: IncidentSink | None = None
        floor = FloorPolicy(
            mode=config.on_loss_scale_floor,
            floor=config.loss_scale_floor,
            steps=config.loss_scale_floor_steps,
            rank=rank,
            emit=emit,
            origins=lambda: incidents.origin_steps() if incidents is not None else [],
            checkpoint=last_checkpoint,
            flush=flush,
            on_error=guard.error,
        )
        incidents = IncidentSink(
            emit=emit,
            evidence=tag_evidence(forensics.evidence, attempt),
            rank=rank,
            loss_scale_floor=config.loss_scale_floor,
            param_grad=index.grad_of,
            scaler_state=functools.partial(scaler_state, scaler),
            floor_policy=floor,
            device=ctx.identity.device,
        )
        manifest = ManifestSink(manifest_writer(ctx, config, manifest_extra, guard))

        sinks: list[Any] = [MetricSink(state), incidents]
        if forensics.progress is not None:
            sinks.append(ProgressSink(forensics.progress))
        summary = SummarySink(
            path=ctx.run_dir.summary(rank),
            state=state,
            head=summary_head,
            write_json=write_json_atomic,
        )
        sinks += [summary, manifest]
        if forensics.events is not None:  # the run dir is writable
            with guard("history"):
                history = HistorySink.open(
                    ctx.run_dir,
                    rank,
                    index.group_names,
                    ctx.identity.device,
                    on_error=guard.error,
                    health=guard.writes,
                    step_metrics=chosen(config.step_metrics),
                    stage=stage,
                )
                if history is not None:
                    sinks.append(history)
        return cls(sinks, incidents, floor, manifest)
