"""Replica checksums: data-parallel replicas must hold bit-identical parameters after every
optimizer step, so a replica that does not has met silent data corruption, a one-rank skipped
step, a non-deterministic kernel or a different checkpoint.

Every ``replica_check_every`` steps each rank sums the raw bits of the parameters it holds as a
replica (each viewed as integers of its element size, summed in int64: exact, and the same
whatever the order), one int64 per parameter group, on the device. One small asynchronous
all-gather over the replica group follows, issued at the step's end on every rank alike. The
record thread waits for it and compares: a rank whose checksums differ from its group's
majority is named, with the first parameter group that differs. Nothing is gathered but the
checksums, and nothing is read on the training thread.

Only parameters are compared: buffers such as BatchNorm running statistics are legitimately
per rank unless synchronised. Where replicas live, per strategy, is each source's
``replica_scope`` (DDP: the DDP process group; HSDP: each replicate group; DeepSpeed
ZeRO-0/1/2: its data-parallel group; TP and FSDP2+TP: the TP ranks, over what TP replicates,
``tp_replica_scope``; no replicas under pure FSDP2, ZeRO-3 or a plain module).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class ReplicaScope:
    """The tensors this rank holds that every rank of ``group`` also holds, bit for bit."""

    tensors: Callable[[], Sequence[torch.Tensor]]
    """This step's tensors, read at each check (a DTensor's local shard can be re-pointed at
    lazy init)."""
    positions: Sequence[int]
    """``ParamIndex`` positions of ``params`` (for the group names)."""
    group: Any
    """The process group of the replicas (``None``: the default group)."""
    over: str
    """Who is compared, in words (the manifest's ``replica_check``)."""
    at_forward: bool = False
    """Compare the parameters as the step's first forward finds them, not at the step's end:
    for a strategy whose step rewrites them from elsewhere (ZeRO-1/2's all-gather from the
    owners' partitions), where a fault between two steps would be gone by the step's end."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """A check at which some replicas differed from their group's majority."""

    step: int
    ranks: tuple[int, ...]
    """The ranks that differ from the majority (every rank of the group when none has one)."""
    this_rank: bool
    """This rank is one of them."""
    group: str
    """The first parameter group in which this rank (else the first named rank) differs."""
    replicas: int
    first_check: bool = False
    """The first check of this process: a mismatch there was loaded, not computed."""


@dataclass(slots=True)
class InFlight:
    """One check: the gather still running, and where this rank sits in it."""

    step: int
    work: Any
    gathered: torch.Tensor
    """``(replicas, groups)`` int64: every replica's checksums."""
    ranks: list[int]
    """Global rank of each row."""
    me: int
    """This rank's row."""
    group_names: list[str]
    first_check: bool = False

    def compare(self) -> Divergence | None:
        """Wait for the gather and name the replicas that differ from the majority (record
        thread)."""
        self.work.wait()
        rows = [tuple(r) for r in self.gathered.cpu().tolist()]
        top, count = Counter(rows).most_common(1)[0]
        majority = top if count * 2 > len(rows) else None
        differ = [i for i, r in enumerate(rows) if majority is None or r != majority]
        if not differ:
            return None
        probe = self.me if self.me in differ else differ[0]
        reference = majority or next(r for r in rows if r != rows[probe])
        column = next(
            (g for g, (a, b) in enumerate(zip(rows[probe], reference, strict=True)) if a != b), 0
        )
        return Divergence(
            step=self.step,
            ranks=tuple(self.ranks[i] for i in differ),
            this_rank=self.me in differ,
            group=self.group_names[column],
            replicas=len(rows),
            first_check=self.first_check,
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its element size (no copy)."""
    t = t.detach()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else (
            torch.view_as_real(t).view(_INT_OF_SIZE[t.element_size() // 2])
        )
    return t


def checksums(params: Sequence[torch.Tensor], group_of: torch.Tensor, n_groups: int
              ) -> torch.Tensor:
    """One int64 per parameter group: the sum of its parameters' raw bits (wrapping; exact and
    order-independent). ``group_of``: each parameter's group, on the parameters' device."""
    sums = torch.stack([bits(p).sum(dtype=torch.int64) for p in params])
    out = torch.zeros(n_groups, dtype=torch.int64, device=sums.device)
    return out.index_add_(0, group_of, sums)


class ReplicaCheck:
    """The check for one rank: what it sums, over which group, how often."""

    def __init__(self, scope: ReplicaScope, group_of: Sequence[int], group_names: Sequence[str],
                 every: int) -> None:
        self.scope = scope
        self.every = every
        self.group_names = list(group_names)
        device = scope.tensors()[0].device
        self._group_of = torch.tensor([group_of[p] for p in scope.positions], device=device)
        self._ranks = dist.get_process_group_ranks(scope.group) if scope.group is not None \
            else list(range(dist.get_world_size()))
        self._me = self._ranks.index(dist.get_rank())
        self._first = True
        self.first_check = False
        """The check ``due`` last allowed is the first of this process."""

    @staticmethod
    def of(scope: ReplicaScope | None, index: Any, every: int) -> ReplicaCheck | None:
        """The check for ``scope``, or None where there is nothing to compare (no scope, no
        parameter, a group of one rank, or ``every`` is 0)."""

        if scope is None or not every or not scope.positions or not dist.is_initialized():
            return None
        if dist.get_world_size(scope.group) < 2:
            return None
        return ReplicaCheck(scope, index.group_of, index.group_names, every)

    def due(self, step: int) -> bool:
        """Every ``every`` steps, and at the first step this process takes (a resume from a
        checkpoint is compared at once: every rank resumes at the same step)."""
        self.first_check, self._first = self._first, False
        return self.first_check or step % self.every == 0

    def launch(self, step: int) -> InFlight:
        """Sum and start the gather (training thread; nothing is read back)."""

        mine = checksums(self.scope.tensors(), self._group_of, len(self.group_names))
        flat = torch.empty(len(self._ranks) * mine.numel(), dtype=torch.int64,
                           device=mine.device)
        # all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.10).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(flat, mine, async_op=True, group=self.scope.group)
        return InFlight(step, work, flat.view(len(self._ranks), -1), self._ranks, self._me,
                        self.group_names, self.first_check)


def tp_replica_scope(index: Any) -> tuple[ReplicaScope | None, str]:
    """The parameters tensor parallel replicates (a ``Replicate`` placement on the TP dim: a
    row-wise layer's bias, norms under sequence parallel), compared over the TP ranks: DTensor
    reduces their gradients before the step, so every TP rank holds the same bits. Under
    FSDP2+TP the same parameters are sharded on the data-parallel dim, and the TP ranks of one
    data-parallel coordinate hold the same shard. Plain tensors are not compared: nothing makes
    their gradients identical across the TP ranks (a norm fed a sequence shard has its own)."""
    chosen: list[Any] = []
    where: set[tuple[Any, int]] = set()
    for p in index.params:
        placements = getattr(p, "placements", None)
        if not placements:
            continue
        replicated = [i for i, pl in enumerate(placements) if pl.is_replicate()]
        if len(replicated) == 1 and all(
                pl.is_replicate() or pl.is_shard() for pl in placements):
            chosen.append(p)
            where.add((p.device_mesh, replicated[0]))
    if not chosen:
        return None, "no parameter is replicated over the TP ranks"
    if len(where) != 1:
        return None, "the replicated parameters are not on one TP mesh dim"
    ((mesh, dim),) = where
    positions = [index.position[id(p)] for p in chosen]
    return ReplicaScope(lambda: [p.to_local() for p in chosen], positions, mesh.get_group(dim),
                        "the TP ranks, over the parameters TP replicates (Replicate "
                        "placements)"), ""
