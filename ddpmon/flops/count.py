"""FLOPs of one training step, counted by ``torch.utils.flop_counter.FlopCounterMode``: the ops
that really ran on this rank (forward and backward, attention variants, the experts a router
chose), so a TP or FSDP shard counts its own work and gradient accumulation its micro-batches.

Cost: the counted step runs once under a dispatch mode that inspects every op (a few times
slower than a plain step on CPU); call it on one step, again when shapes change, never per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_flops(step: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``step()`` once under ``FlopCounterMode``; return its result and the FLOPs counted."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False)
    with mode:
        result = step()
    return result, int(mode.get_total_flops())
