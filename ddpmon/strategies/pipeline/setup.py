"""Pipeline parallel set-up: which stages of a ``torch.distributed.pipelining`` schedule this
rank holds, their pp group, the inner strategy (DDP or FSDP2) and what ``attach`` refuses, all
checked once at attach (docs/parallelism.md, Pipeline parallel)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._torch_compat import schedule_microbatches, schedule_stages
from ...probes.grads import unwrap_model
from ..registry import detect_sharded

log = logging.getLogger("ddpmon")

__all__ = [
    "SCALER_REFUSED",
    "TESTED_SCHEDULES",
    "PipelineParts",
    "PipelineSetup",
    "PipelineSetupError",
    "StageInfo",
]

SCALER_REFUSED = (
    "a GradScaler is not supported under pipeline parallel: only the last stage sees the loss, "
    "so scaler.step() raises 'Attempted step but _scale is None' on the other stages, and "
    "found_inf is not reduced over the pp group (stages skip different steps). Train in fp32 "
    "or bf16 (autocast, or FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16)) without a "
    "scaler, and attach without one"
)
TESTED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")


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
    return schedule_stages(schedule)


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
        self.n_microbatches = schedule_microbatches(schedule)
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

        kind = detect_sharded(self.container)
        if kind is not None and kind.startswith("unsupported:"):
            raise PipelineSetupError(f"pipeline stages wrapped in {kind.split(':', 1)[1]}")
        return kind or "plain"

    @property
    def has_loss(self) -> bool:
        """The loss exists on the last stage only."""
        return any(s.is_last for s in self.stages)
