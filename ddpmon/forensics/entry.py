"""Which rank a NaN entered on, when every rank of a tensor-parallel group saw it in one step.

Under tensor parallel the collectives inside a block's backward spread a NaN to every rank of the
TP group in the same backward, so each rank's own gradients say ``origin`` and name the same
parameter; the earliest event would be a race between the ranks' writes. Each such event carries
``entry`` and ``entry_depth`` (``strategies.block_entry``): the block nearest the loss whose
output gradient was non-finite on that rank, and its place from the loss end (0: the last
block). Between blocks the gradient is this rank's own (sequence-sharded), so the rank the NaN
entered on has it non-finite one block nearer the loss than the ranks it spread to.

Among the origin ``nonfinite`` events of the first failure's attempt and step, the one whose
``entry_depth`` is smallest is the first failure (earliest time among equals). Where that does
not single out one rank (equal depths: the NaN entered inside a block, where a collective mixed
it before the next block boundary; or some events carry no entry), the ranks that cannot be
told apart are listed in ``tied_ranks`` and the earliest of them is named. Events without an
``entry`` (no tensor parallel) keep the order by time alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["nearest_entry"]


def nearest_entry(first: dict[str, Any], events: list[dict[str, Any]]
                  ) -> tuple[dict[str, Any], list[int] | None]:
    """``(first failure, tied ranks or None)``: ``first`` replaced by the origin event of its
    step whose NaN entered nearest the loss (module doc)."""
    if first.get("kind") != "nonfinite" or first.get("origin") is not True:
        return first, None
    key = (first.get("attempt"), first.get("step"))
    peers: dict[Any, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: _time(e)):
        if (e.get("kind") == "nonfinite" and e.get("origin") is True
                and (e.get("attempt"), e.get("step")) == key):
            peers.setdefault(e.get("rank"), e)
    if len(peers) < 2 or not any(_depth(e) is not None for e in peers.values()):
        return first, None
    if any(_depth(e) is None for e in peers.values()):
        return first, sorted(r for r in peers if isinstance(r, int))
    best = min(_depth(e) for e in peers.values())  # type: ignore[type-var]
    nearest = [e for e in peers.values() if _depth(e) == best]
    chosen = min(nearest, key=_time)
    tied = sorted(r for r in (e.get("rank") for e in nearest) if isinstance(r, int))
    return chosen, (tied if len(tied) > 1 else None)


def _depth(e: dict[str, Any]) -> int | None:
    depth = e.get("entry_depth")
    return depth if isinstance(depth, int) and not isinstance(depth, bool) else None


def _time(e: dict[str, Any]) -> float:
    t = e.get("t")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else float("inf")
