"""What a run dir's claims may make a reader do: a claim (a world size in a ``start`` event, an
attempt number) is a label, never a loop bound, so a two-line file cannot make ``timeline``
build ten million ranks. Readers group events once and stay linear in what the files hold."""

from __future__ import annotations

from typing import Any

MAX_WORLD_SIZE = 1_000_000
"""The largest world size a ``start`` event may claim (the daemon's job API takes no more); a
larger claim is damage, and the ranks present stand for the run."""
MAX_MISSING_LISTED = 1024
"""``missing_ranks`` lists at most this many (the lowest); ``missing_count`` counts them all."""


def missing_ranks(world_size: int | None, ranks: dict[int, Any]) -> tuple[list[int], int]:
    """The lowest missing ranks of ``world_size`` (at most :data:`MAX_MISSING_LISTED`) and how
    many are missing, in time linear in the ranks present, never in the world size."""
    if not world_size:
        return [], 0
    present = sorted(r for r in ranks if 0 <= r < world_size)
    count = world_size - len(present)
    listed: list[int] = []
    nxt = 0
    for r in [*present, world_size]:
        listed.extend(range(nxt, min(r, nxt + MAX_MISSING_LISTED - len(listed))))
        nxt = r + 1
        if len(listed) >= MAX_MISSING_LISTED:
            break
    return listed, count


def grouped(events: list[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    """``events`` split by ``key`` (``rank`` or ``attempt``), each list in the given order: one
    pass, so per-rank and per-attempt work stays linear in the events."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        out.setdefault(e.get(key, 0), []).append(e)
    return out
