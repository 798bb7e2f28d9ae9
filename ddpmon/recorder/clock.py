"""This rank's wall-clock offset against rank 0, so events of all ranks share one time axis.

Method (``"all_gather-bounds"``): in each round every rank stamps ``a = time.time()``, all-gathers
it, stamps ``b``, and all-gathers ``b``. An all-gather cannot finish on any rank before every rank
has entered it, so in real time rank 0's ``a0`` precedes this rank's ``b`` and this rank's ``a``
precedes rank 0's ``b0``. With ``offset`` = rank-0 clock minus this clock that gives
``a0 - b <= offset <= b0 - a``: a hard interval, whatever the network's asymmetry. The round with
the narrowest interval wins; the offset is its midpoint and ``rtt_seconds`` its width (the
uncertainty is half of it). Two collectives per round, O(1) in the number of ranks.

Collective: every rank of the default group must call it (the agent does, at attach).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("ddpmon.clock")


def measure_clock_offset(rounds: int = 5) -> dict[str, Any]:
    """``{"offset_seconds", "rtt_seconds", "method", "rounds"}``; add the offset to this rank's
    ``time.time()`` to get rank 0's. Without an initialised process group: offset 0."""
    if not (dist.is_available() and dist.is_initialized()):
        return _none("no process group")
    try:
        world = dist.get_world_size()
        if world == 1:
            return _none("single rank")
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        best: tuple[float, float] | None = None  # (width, midpoint)
        for _ in range(max(1, rounds)):
            a = time.time()
            a_all = _gather(torch, dist, a, world, device)
            b = time.time()
            b_all = _gather(torch, dist, b, world, device)
            low, high = a_all[0] - b, b_all[0] - a
            width = max(high - low, 0.0)
            if best is None or width < best[0]:
                best = (width, (low + high) / 2.0)
        assert best is not None
        if dist.get_rank() == 0:
            return {"offset_seconds": 0.0, "rtt_seconds": best[0], "method": METHOD,
                    "rounds": rounds}
        return {"offset_seconds": best[1], "rtt_seconds": best[0], "method": METHOD,
                "rounds": rounds}
    except Exception as exc:  # never into training; unaligned events beat no events
        log.warning("ddpmon clock offset measurement failed: %s", exc)
        return {"offset_seconds": 0.0, "rtt_seconds": None, "method": f"failed: {exc}",
                "rounds": 0}


METHOD = "all_gather-bounds"


def _gather(torch: Any, dist: Any, value: float, world: int, device: Any) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [float(t.item()) for t in out]


def _none(why: str) -> dict[str, Any]:
    return {"offset_seconds": 0.0, "rtt_seconds": 0.0, "method": f"none ({why})", "rounds": 0}
