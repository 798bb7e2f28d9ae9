"""The goodput alert: over a window, too little of the run's wall-clock time trained the model
(docs/goodput.md). Rank 0 exports the run's goodput buckets (``goodput_seconds``), so this is one
alert per run; the window's goodput is the productive seconds it gained over the wall-clock
seconds it lasted, so a run that lost an hour to restarts fires even after a good first day."""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin.alerts import RUN, Alert
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.IDENTITY


def alerts(c: MixinConfig) -> list[Alert]:
    productive = sel(c, m.GOODPUT_SECONDS.name, 'bucket="productive"')
    wall = sel(c, m.GOODPUT_WALL.name)
    w = c.goodput_window
    floor, percent = f"{c.goodput_floor:g}", f"{c.goodput_floor:.0%}"
    return [
        Alert(
            "DdpmonGoodputLow", L, "warning",
            f"(\n  max without (bucket) (delta({productive}[{w}]))\n  /\n"
            f"  delta({wall}[{w}])\n) < {floor}",
            c.goodput_for,
            "Too little of the run's wall-clock time trained the model.",
            f"{RUN} (rank 0 exports it for the run): goodput over the last {w} was "
            "{{ $value | humanizePercentage }} "
            f"(floor {percent}); `ddpmon timeline` names the buckets that took the rest "
            "(restarts, lost progress, initialisation, checkpoints, data wait).",
        ),
    ]
