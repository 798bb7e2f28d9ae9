"""What marks a DeepSpeed step (``DeepSpeedSource.markers``): ``engine.step`` wrapped
(:mod:`.steps`), the rerun around it under ``on_nonfinite='rerun'`` (:mod:`.rerun`), and
DeepSpeed's own "loss scale already at minimum" exception handed to the agent's floor policy as
an ``EngineFloor`` (``source="deepspeed"``, with DeepSpeed's first sentence)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..base import EngineFloor, StepHost
from .rerun import EngineRerun
from .steps import EngineSteps


def engine_markers(source: Any, host: StepHost) -> list[Any]:
    """``engine.step`` wrapped for ``source`` (a ``DeepSpeedSource``), with the rerun when the
    agent runs one."""
    steps = EngineSteps(source.engine, source, host.on_engine_step, host.on_error,
                        on_min_scale=functools.partial(_floor, host.on_engine_floor))
    # the engine's step is where its optimizer starts and its backward ends (straggler split)
    steps.on_call = host.steps.split.optimizer_started
    if host.steps.rerun is not None:
        rerun = EngineRerun(host.steps, source, source.engine)
        steps.before_step = rerun.before_step
        steps.after_step = rerun.after_step
    return [steps]


def _floor(report: Callable[[EngineFloor], None], exc: BaseException,
           scale: float | None) -> None:
    report(EngineFloor(source="deepspeed", scale=scale, cause=exc,
                       head=functools.partial(_head, scale)))


def _head(scale: float | None, step: int) -> str:
    shown = "unknown" if scale is None else f"{scale:g}"
    return (f"ddpmon: DeepSpeed's loss scale reached its minimum ({shown}) and "
            f"overflowed again at step {step}")
