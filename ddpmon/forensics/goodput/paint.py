"""Paint one rank's time line: measured intervals (steps, data waits, checkpoint I/O, marked
phases) over a window, the highest priority winning where they overlap, and every instant no
interval covers given to a bucket by ``fill`` (initialisation, failure detection, restart gap,
other). The painted segments tile the window, so their seconds add up to it exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .buckets import PRIORITY


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float
    bucket: str


def paint(spans: Iterable[Span], start: float, end: float, fill: Callable[[float], str],
          cuts: Iterable[float] = ()) -> list[Span]:
    """Segments tiling ``[start, end]``, each with one bucket; ``cuts`` are extra boundaries
    (attempt starts, a step's end) where ``fill``'s answer may change. Sorting dominates:
    O(n log n) in the spans."""
    if end <= start:
        return []
    changes: list[tuple[float, int, str]] = []
    for s in spans:
        a, b = max(s.start, start), min(s.end, end)
        if b > a:
            changes.append((a, 1, s.bucket))
            changes.append((b, -1, s.bucket))
    changes.sort(key=lambda c: c[0])
    cuts = [t for t in cuts if start < t < end]
    bounds = sorted({start, end, *(c[0] for c in changes),
                     *cuts})
    cut_set = set(cuts)
    active: dict[str, int] = {}
    out: list[Span] = []
    i = 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        while i < len(changes) and changes[i][0] <= lo:
            _, delta, bucket = changes[i]
            active[bucket] = active.get(bucket, 0) + delta
            i += 1
        live = [b for b, n in active.items() if n > 0]
        bucket = max(live, key=lambda b: PRIORITY.get(b, 0)) if live else fill((lo + hi) / 2)
        if out and out[-1].bucket == bucket and out[-1].end == lo and lo not in cut_set:
            out[-1] = Span(out[-1].start, hi, bucket)
        else:
            out.append(Span(lo, hi, bucket))
    return out
