"""The duplicate-data check shared by every strategy with data-parallel ranks.

Replicas of one data-parallel group hold identical parameters, so two of them whose *local*
(pre-reduction) gradients are bit-identical were fed identical batches: a duplicated data shard
(every rank seeded alike, a sampler given the wrong rank). Every ``data_check_interval`` steps
each rank all-gathers one float64 over that group: the sum of squares of per-parameter local
norms it already measured (no extra pass). The gather is asynchronous, issued at the same point
of the backward on every rank of the group, and read back lazily with the step vector.

Where it runs: DDP (the first bucket), FSDP2 and FSDP2 + TP (the first unit's reduce-scatter
input, over the reduce-scatter group: the dp dim only), HSDP (over the shard group and over the
replicate group), DeepSpeed (the local norms of the step, at the boundary ``engine.step``),
pipeline parallel with DDP or FSDP2 (over each stage's dp group). Where it does not (TP alone,
no data-parallel wrapper), the manifest's ``data_check`` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class Fingerprint:
    """One check in flight: per group, the async gather and every rank's value; and ours."""

    mine: torch.Tensor
    gathers: list[tuple[Any, torch.Tensor]]


def due(interval: int, steps_taken: int) -> bool:
    """A check on this step (the first step is always checked when the check is on)."""
    return bool(interval) and steps_taken % interval == 0


def launch(local_norms: torch.Tensor, groups: Sequence[Any]) -> Fingerprint | None:
    """All-gather this rank's fingerprint over each group of more than one rank (``None``:
    the default group). Every rank of a group must call this at the same point."""

    wide = local_norms.to(torch.float64)  # one dtype on every rank, whatever happened
    mine = (wide * wide).sum().reshape(1)
    # all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.10).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gathers = []
    for group in groups:
        size = dist.get_world_size(group)
        if size < 2:
            continue
        gathered = torch.empty(size, dtype=mine.dtype, device=mine.device)
        gathers.append((gather(gathered, mine, async_op=True, group=group), gathered))
    return Fingerprint(mine, gathers) if gathers else None


def identical_ranks(fp: Fingerprint | None, on_error: Callable[[str, BaseException], None]
                    ) -> torch.Tensor | None:
    """Device count of other ranks, over the checked groups, whose fingerprint equals ours (a
    rank in two groups with us counts once per group; zero or non-finite never matches)."""
    if fp is None:
        return None
    try:
        valid = (fp.mine > 0) & torch.isfinite(fp.mine)
        total = None
        for work, gathered in fp.gathers:
            work.wait()  # done by now (it preceded the step's reductions); on NCCL a stream wait
            same = ((gathered == fp.mine) & valid).sum() - valid.to(torch.int64).sum()
            total = same if total is None else total + same  # ourselves excluded
        return torch.clamp(total, min=0) if total is not None else None
    except Exception as exc:
        on_error("data", exc)
        return None
