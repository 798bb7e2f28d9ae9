"""Goodput as ``ddpmon timeline`` prints it: the ratios, then each bucket's seconds and share,
per attempt too when there were several."""

from __future__ import annotations

from ...terminal import SafeConsole, shown
from .account import Goodput
from .buckets import BUCKETS

MAX_ATTEMPT_COLUMNS = 8


def lines(g: Goodput) -> list[str]:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    out = [f"Goodput {pct(g.goodput)} (productive step time / wall-clock), ETTR {pct(g.ettr)}; "
           f"wall-clock {g.wall_seconds:.3f}s from the first process start"
           f" ({g.start_t - g.t0:+.3f}s) to {g.end_t - g.t0:+.3f}s, mean over "
           f"{len(g.ranks)} rank(s)"]
    shown = g.attempts[:MAX_ATTEMPT_COLUMNS] if len(g.attempts) > 1 else []
    head = f"  {'bucket':34} {'seconds':>10} {'share':>7}" + "".join(
        f" {'attempt ' + str(a['attempt']):>11}" for a in shown)
    out.append(head)
    for b in BUCKETS:
        v = g.buckets[b.name]
        row = f"  {b.name:34} {v:10.3f} {pct(v / g.wall_seconds) if g.wall_seconds else '':>7}"
        row += "".join(f" {a['buckets'][b.name]:11.3f}" for a in shown)
        out.append(row)
    if len(g.attempts) > MAX_ATTEMPT_COLUMNS:
        out.append(f"  ({len(g.attempts) - MAX_ATTEMPT_COLUMNS} more attempts in --json)")
    out.extend(f"  estimated: {line}" for line in g.estimated)
    return out


def render(g: Goodput) -> None:
    console = SafeConsole(highlight=False)
    console.print("[bold]Goodput[/bold]")
    for line in lines(g):
        console.print(shown(line), markup=False)
