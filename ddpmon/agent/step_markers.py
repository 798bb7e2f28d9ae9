"""What tells the step flow where a step is, by kind of loop: torch's module and optimizer
hooks (``hooks.StepHooks``) always; whatever the strategy marks its own steps with
(``GradientSource.markers``: a loop driver's or an engine's ``step()``), asked of the
source through a ``StepHost`` and never named here; under tensor parallel, the block-output
checks that say where a NaN entered (``strategies.block_entry``). Installed all or nothing,
removed together."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..probes.amp import ScalerProbe
from ..strategies.base import EngineFloor, GradientSource, StepHost
from ..strategies.block_entry import BlockEntry, tensor_parallel
from .hooks import StepHooks
from .step_flow import StepFlow


class StepMarkers:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        flow: StepFlow,
        source: GradientSource,
        *,
        amp: ScalerProbe | None,
        on_error: Callable[[str, BaseException], None],
        on_engine_step: Callable[[Any], None],
        on_engine_floor: Callable[[EngineFloor], None],
    ) -> None:
        self.hooks: StepHooks | None = None
        self.own: list[Any] = []
        """The strategy's own markers (``GradientSource.markers``)."""
        self.entry: BlockEntry | None = None
        try:
            self.hooks = StepHooks(
                model, optimizer, flow, amp, engine_steps=source.decides_steps
            )
            if tensor_parallel(source.name):  # where a NaN entered: the parameters cannot say
                flow.entry = self.entry = BlockEntry.install(model, on_error)
            host = StepHost(model=model, optimizer=optimizer, steps=flow, on_error=on_error,
                            on_engine_step=on_engine_step, on_engine_floor=on_engine_floor)
            self.own = list(source.markers(host))
        except BaseException:
            with contextlib.suppress(Exception):  # all or nothing; the first error is raised
                self.close()
            raise

    def close(self) -> None:
        """Remove every marker; one that fails to come off does not keep the others on (the
        first failure is raised after all were tried)."""
        first: BaseException | None = None
        for part in (self.hooks, *self.own, self.entry):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first
