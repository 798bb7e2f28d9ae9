"""Every strategy ddpmon knows, in one table: its name (``ddpmon_rank_info{strategy}``), the
gradient source that measures it, and the facts other layers ask about it. No torch import:
the exporter and the docs read it too.

To add a strategy: a row here and its source class (``strategies/<name>.py``); detection
(``detect.detect_strategy``, ``kinds.detect_sharded``) must return the row's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    source: str
    """``module:Class`` of its gradient source, imported lazily (FSDP2/DTensor code is only
    loaded where it is used)."""
    sharded: bool = False
    """Parameters are DTensors (FSDP2, HSDP, TP and their mixes)."""
    reduced_identical: bool = True
    """Every rank computes the same reduced global and group norms (the whole model's): under
    ``series_profile="large"`` rank 0's copy stands for all. ``plain`` (no wrapper: ranks may
    train different things) is not."""


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


def reduced_norms_identical(strategy: str) -> bool:
    """True when every rank of the job computes the same reduced global and group norms."""
    if strategy.startswith("deepspeed-zero"):
        strategy = "deepspeed"
    row = STRATEGIES.get(strategy)
    return row is not None and row.reduced_identical
