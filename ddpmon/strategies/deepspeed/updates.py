"""What DeepSpeed's optimizer step updates, for the per-group update figures (docs/loss-spikes.md):
ZeRO 1-3 step fp32 partitions of their own (``probes.zero_updates``), ZeRO-0 a torch optimizer
(the default probe on it); a wrapper ddpmon cannot read (``BF16_Optimizer``, NVMe-swapped state,
DeepCompile) turns the figures off with one warning."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...probes.zero_updates import zero_probe
from ..base import UpdateSettings

log = logging.getLogger("ddpmon")


def engine_update_probe(engine: Any, facts: Any, settings: UpdateSettings,
                        default: Callable[[Any], Any]) -> Any:
    """The update probe of ``engine``'s optimizer step, or None (figures off, said once)."""
    if facts.unreadable:  # what DeepSpeed steps there is not what ddpmon reads
        log.warning("ddpmon: update figures off under DeepSpeed: %s", ", ".join(facts.unreadable))
        return None
    if facts.stage in (1, 2, 3):
        return zero_probe(engine, facts.stage, settings.index, settings.every, settings.step_of,
                          settings.on_error, settings.copy_budget)
    optimizer = engine.optimizer  # ZeRO-0: the torch optimizer itself, or a wrapper
    if not isinstance(optimizer, torch.optim.Optimizer):
        log.warning("ddpmon: update figures off under DeepSpeed: %s steps ZeRO-0",
                    type(optimizer).__name__)
        return None
    return default(optimizer)
