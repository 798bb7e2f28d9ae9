"""What ``attach``'s arguments mean for each strategy, decided before anything is built, so that
the agent names no strategy: the engine an ``Accelerator`` prepared, Fabric's wrappers (and DDP
inside another wrapper), pipeline parallel's ``schedule=``, a DeepSpeed engine's own optimizer,
and why a combination cannot be monitored (``Refused``, whose message the agent logs and
returns as ``mon.error``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .accelerate import deepspeed_engine, parts_from_accelerator, unwrap_optimizer
from .base import GradientSource, SourceEnv
from .deepspeed.source import BARE_MODULE_WARNING, attach_error, is_engine
from .pipeline.setup import PipelineSetup, PipelineSetupError
from .pipeline.source import PipelineSource
from .registry import detect_strategy
from .wrappers import unwrap

log = logging.getLogger("ddpmon")


class Refused(Exception):
    """These arguments cannot be monitored; the message says why."""


@dataclass(slots=True)
class Plan:
    """A strategy chosen by ``attach``'s own arguments rather than detected from the model
    (pipeline parallel's ``schedule=``)."""

    strategy: str
    make_source: Callable[[SourceEnv], GradientSource]
    group_levels: int = 0
    """Extra levels of parameter-group names (pipeline parallel: ``stage<k>`` first)."""


@dataclass(slots=True)
class Resolved:
    model: Any
    optimizer: Any
    scaler: Any
    plan: Plan | None = None


def resolve(model: Any, optimizer: Any, scaler: Any, *, accelerator: Any = None,
            schedule: Any = None) -> Resolved:
    """The module, optimizer and scaler to measure, and the plan when the arguments chose the
    strategy; raises ``Refused``."""
    plan = None
    if schedule is not None:
        try:
            setup = PipelineSetup(model, schedule, scaler)
        except PipelineSetupError as exc:
            raise Refused(str(exc)) from exc
        plan = Plan(setup.strategy, lambda env: PipelineSource(env, setup), group_levels=1)
        model = setup.container
    if accelerator is not None:  # under DeepSpeed: the engine, not the module inside it
        engine = deepspeed_engine(accelerator, model)
        if engine is not None:
            model, optimizer = engine, engine.optimizer
    if plan is None:  # Fabric's wrappers, or DDP inside another wrapper (wrappers)
        model, optimizer = unwrap(model, optimizer)
    reason = _refused(model, optimizer)
    if reason is not None:
        raise Refused(reason)
    if optimizer is None:
        optimizer = model.optimizer  # a DeepSpeedEngine (checked by _refused)
    if accelerator is not None:
        optimizer = unwrap_optimizer(optimizer)
        if scaler is None:
            scaler = parts_from_accelerator(accelerator).get("scaler")
    return Resolved(model, optimizer, scaler, plan)


def _refused(model: Any, optimizer: Any) -> str | None:
    """Why these arguments cannot be monitored (checked before anything is built), or None."""
    if "deepspeed" in sys.modules or "deepspeed" in type(model).__module__:
        reason = attach_error(model, optimizer)
        if reason is not None or is_engine(model):
            return reason
        if optimizer is not None and detect_strategy(model) == "plain":
            # maybe before deepspeed.initialize: say so
            log.warning(BARE_MODULE_WARNING)
    if optimizer is None:
        return "attach(model, optimizer): the optimizer is required (only a DeepSpeedEngine " \
            "carries its own)"
    return None
