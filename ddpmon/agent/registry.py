"""The monitors alive in this process, found by the parameters they own.

``ddpmon.clip_grad_norm_`` asks for the monitor of *its* parameters, so two monitors in one
process (two models) each serve their own; nothing global decides which one is "active".
Importing this module registers ``monitor_for`` with ``ddpmon.agent.clip`` (which sits below the
agent and so cannot import it).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .clip import set_monitor_lookup

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def add(monitor: Any) -> None:
    _live.add(monitor)


def discard(monitor: Any) -> None:
    _live.discard(monitor)


def monitor_for(params: Sequence[torch.Tensor]) -> Any:
    """The live monitor whose model owns ``params``, or None."""
    if not params:
        return None
    for mon in list(_live):
        if mon.owns(params):
            return mon
    return None


set_monitor_lookup(monitor_for)
