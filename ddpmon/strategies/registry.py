"""Every strategy ddpmon knows, in one registry: its name (``ddpmon_rank_info{strategy}``), the
gradient source that measures it, the facts other layers ask about it, and how a model is told
to be one of them at attach (docs/architecture.md, Add a strategy).

The agent asks this registry for a source (``detect_strategy``, ``make_source``) and talks to it
through ``base.GradientSource`` only: it names no strategy. A source class is named as
``module:Class`` and imported lazily (FSDP2/DTensor code is only loaded where it is used). A
model ddpmon cannot analyse (FSDP1; a pipelining module attached without ``schedule=``) gets
one warning and local numbers only. Pipeline parallel proper goes through
``attach(model_parts, opt, schedule=)`` (``attach_args``, ``pipeline``), not detection.

To add a strategy: its source class (a ``base.GradientSource``: how it measures, what marks its
steps, what it adds to the manifest) and its row: in ``STRATEGIES`` with detection here for one
ddpmon ships, or ``register(Strategy(name, SourceClass, claims=...))`` for one it does not
(``tests/unit/test_recipe_strategy.py``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import GradientSource, SourceEnv
from .deepspeed.source import is_engine
from .dtensor_norms import is_dtensor, is_sharded

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None  # type: ignore[assignment,misc]

log = logging.getLogger("ddpmon")


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    source: str | type[GradientSource]
    """``module:Class`` of its gradient source, imported lazily (FSDP2/DTensor code is only
    loaded where it is used), or the class itself (a strategy ddpmon does not ship)."""
    sharded: bool = False
    """Parameters are DTensors (FSDP2, HSDP, TP and their mixes)."""
    reduced_identical: bool = True
    """Every rank computes the same reduced global and group norms (the whole model's): under
    ``series_profile="large"`` rank 0's copy stands for all. ``plain`` (no wrapper: ranks may
    train different things) is not."""
    claims: Callable[[torch.nn.Module], bool] | None = None
    """A registered strategy's test: True when the attached model is one of its (asked before
    ddpmon's own detection, in registration order)."""


_FSDP = "ddpmon.strategies.fsdp.source:FSDPSource"
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("plain", "ddpmon.strategies.plain:PlainSource", reduced_identical=False),
    Strategy("ddp", "ddpmon.strategies.ddp:DDPSource"),
    Strategy("fsdp2", _FSDP, sharded=True),
    Strategy("hsdp", _FSDP, sharded=True),
    Strategy("tp", "ddpmon.strategies.tensor_parallel:TensorParallelSource", sharded=True),
    Strategy("fsdp2+tp", _FSDP, sharded=True),
    Strategy("hsdp+tp", _FSDP, sharded=True),
    Strategy("deepspeed", "ddpmon.strategies.deepspeed.source:DeepSpeedSource"),
)}
"""By detected name. A DeepSpeed source renames itself ``deepspeed-zero<N>`` once it knows the
stage; pipeline parallel (``pp``, ``pp+<inner>``) is built by ``attach(..., schedule=)``, not
detected, and ``unsupported:*`` names have no row."""

SHARDED = tuple(name for name, s in STRATEGIES.items() if s.sharded)
SHARDED_KINDS = SHARDED
"""The sharded rows (what ``detect_sharded`` may return, besides ``unsupported:fsdp1``)."""

SOURCES: dict[str, str | type[GradientSource]] = {n: s.source for n, s in STRATEGIES.items()}
"""Strategy name -> its source's ``module:Class`` (or class)."""


def register(strategy: Strategy) -> Strategy | None:
    """Add (or replace) a strategy's row, for a strategy ddpmon does not ship: a model its
    ``claims`` accepts is then measured by its source (``make_source``), and the exporter reads
    its facts. Returns the row it replaced, if any (``unregister`` puts it back)."""
    before = STRATEGIES.get(strategy.name)
    STRATEGIES[strategy.name] = strategy
    SOURCES[strategy.name] = strategy.source
    return before


def unregister(name: str, before: Strategy | None = None) -> None:
    """Take a registered row out again (or put back the row ``register`` replaced)."""
    STRATEGIES.pop(name, None)
    SOURCES.pop(name, None)
    if before is not None:
        register(before)


def reduced_norms_identical(strategy: str) -> bool:
    """True when every rank of the job computes the same reduced global and group norms."""
    if strategy.startswith("deepspeed-zero"):
        strategy = "deepspeed"
    row = STRATEGIES.get(strategy)
    return row is not None and row.reduced_identical


# ---------------------------------------------------------------------- detection
PIPELINE_HINT = (
    "ddpmon: a torch.distributed.pipelining module was attached without its schedule; "
    "attach the stage modules with ddpmon.attach(model_parts, optimizer, schedule=schedule) "
    "(docs/parallelism.md, Pipeline parallel). Reporting this rank's local numbers only."
)


def detect_strategy(model: torch.nn.Module) -> str:
    """plain | ddp | fsdp2 | hsdp | tp | fsdp2+tp | deepspeed | unsupported:<what>
    (``deepspeed``: a ``DeepSpeedEngine``; its source labels itself ``deepspeed-zero<stage>``)."""
    kind = type(model).__module__ + "." + type(model).__name__
    for name, row in list(STRATEGIES.items()):  # registered strategies first
        if row.claims is not None and row.claims(model):
            return name
    if is_engine(model):
        if type(model).__name__ == "PipelineEngine":
            return "unsupported:deepspeed-pipeline"
        return "deepspeed"
    if "deepspeed" in kind.lower():
        return "unsupported:deepspeed"
    if "pipelining" in kind.lower():
        return "unsupported:pipeline-parallel"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    sharded = detect_sharded(model)
    if sharded:
        return sharded
    return "plain"


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_fsdp1(model: torch.nn.Module) -> bool:
    return any(
        type(m).__module__.startswith("torch.distributed.fsdp.fully_sharded_data_parallel")
        for m in model.modules()
    )


def _is_hsdp(param: torch.Tensor) -> bool:
    placements = param.placements
    return len(placements) >= 2 and placements[0].is_replicate() and is_sharded(placements[1])


def detect_sharded(model: torch.nn.Module) -> str | None:
    """``fsdp2``, ``hsdp``, ``tp``, ``fsdp2+tp``, ``hsdp+tp``, ``unsupported:fsdp1`` or None
    (not sharded: plain or DDP, decided by ``detect_strategy``). It reads only module types and
    DTensor placements: no collective, no device access."""
    if _is_fsdp1(model):
        return "unsupported:fsdp1"
    has_fsdp = bool(fsdp_modules(model))
    dtensors = [p for p in model.parameters() if is_dtensor(p)]
    if has_fsdp:
        hsdp = any(_is_hsdp(p) for p in dtensors)
        fsdp_dims = 2 if hsdp else 1
        base = "hsdp" if hsdp else "fsdp2"
        tp = any(p.device_mesh.ndim > fsdp_dims for p in dtensors)
        return f"{base}+tp" if tp else base
    return "tp" if dtensors else None


# ---------------------------------------------------------------------- building a source
def make_source(strategy: str, env: SourceEnv) -> GradientSource:
    target = SOURCES.get(strategy)
    if strategy == "unsupported:pipeline-parallel":
        log.warning(PIPELINE_HINT)
        target = SOURCES["plain"]
    if target is None:
        log.warning(
            "ddpmon: %s is not supported yet; reporting this rank's local gradient numbers only "
            "(no global norm across ranks, no origin analysis).",
            strategy.split(":", 1)[-1],
        )
        target = SOURCES["plain"]
    if not isinstance(target, str):
        return target(env)  # a registered class
    module_name, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        log.warning("ddpmon: no gradient source for %s (%s); local numbers only", strategy, exc)
        cls = importlib.import_module("ddpmon.strategies.plain").PlainSource
    return cls(env)


__all__ = [
    "PIPELINE_HINT", "SHARDED", "SHARDED_KINDS", "SOURCES", "STRATEGIES", "Strategy",
    "detect_sharded", "detect_strategy", "fsdp_modules", "make_source", "reduced_norms_identical",
    "register", "unregister",
]
