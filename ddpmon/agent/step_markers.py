"""What tells the step pipeline where a step is, by kind of loop: torch's module and optimizer
hooks (``hooks.StepHooks``) always; a pipeline schedule's ``step()`` under pipeline parallel
(``ScheduleStep``); DeepSpeed's ``engine.step()`` where the engine decides the optimizer
steps (``EngineSteps``, with ``EngineRerun`` under the rerun policy); under tensor parallel,
the block-output checks that say where a NaN entered (``strategies.block_entry``). Installed all or
nothing, removed together."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..probes.amp import ScalerProbe
from ..strategies.base import GradientSource
from ..strategies.block_entry import BlockEntry, tensor_parallel
from ..strategies.deepspeed_steps import EngineSteps
from ..strategies.pp_probes import ScheduleStep
from .engine_rerun import EngineRerun
from .hooks import StepHooks
from .pipeline import StepPipeline


class StepMarkers:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        pipeline: StepPipeline,
        source: GradientSource,
        *,
        amp: ScalerProbe | None,
        pp: Any,
        on_error: Callable[[str, BaseException], None],
        on_engine_step: Callable[[Any], None],
        on_min_scale: Callable[[BaseException, float | None], None],
    ) -> None:
        self.hooks: StepHooks | None = None
        self.schedule_step: Any = None
        self.engine_steps: Any = None
        self.entry: BlockEntry | None = None
        try:
            self.hooks = StepHooks(
                model, optimizer, pipeline, amp, engine_steps=source.decides_steps
            )
            if tensor_parallel(source.name):  # where a NaN entered: the parameters cannot say
                pipeline.entry = self.entry = BlockEntry.install(model, on_error)
            if pp is not None:
                self.schedule_step = ScheduleStep(pp, pipeline, on_error)
                self.schedule_step.install()
            if source.decides_steps:
                self.engine_steps = EngineSteps(
                    model, source, on_engine_step, on_error, on_min_scale=on_min_scale
                )
                self.engine_steps.on_call = pipeline.split.optimizer_started
                if pipeline.rerun is not None:
                    rerun = EngineRerun(pipeline, source, model)
                    self.engine_steps.before_step = rerun.before_step
                    self.engine_steps.after_step = rerun.after_step
        except BaseException:
            with contextlib.suppress(Exception):  # all or nothing; the first error is raised
                self.close()
            raise

    def close(self) -> None:
        """Remove every marker; one that fails to come off does not keep the others on (the
        first failure is raised after all were tried)."""
        first: BaseException | None = None
        for part, method in (
            (self.hooks, "close"), (self.schedule_step, "uninstall"), (self.engine_steps, "close"),
            (self.entry, "close"),
        ):
            if part is None:
                continue
            try:
                getattr(part, method)()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first
