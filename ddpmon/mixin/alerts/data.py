"""Data-supply alerts: duplicated shards and a rank starved of data.

A starved rank holds the run back like a straggler, but its cause is the input pipeline: its
peers finish their step and wait for it inside the all-reduce, so their all-reduce time grows
(DdpmonCollectiveSlow, which Alertmanager inhibits while DdpmonDataStarved fires for the run).
DdpmonStraggler deliberately excludes data wait; this alert is the one that names the rank.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin.alerts import RANK, RUN, Alert, rank_list
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.DATA_SUPPLY
BY_RUN = 'run="%s"'


def alerts(c: MixinConfig) -> list[Alert]:
    def identical(extra: str = "") -> str:
        # changes(), not increase(): it counts scrapes at which the counter grew, exactly,
        # where increase() extrapolates one increment to more than 1.
        return (
            f"changes({sel(c, m.DATA_IDENTICAL_BATCHES.name, extra)}"
            f"[{c.data_duplicate_window}]) >= {c.data_duplicate_min_samples}"
        )

    return [
        Alert(
            "DdpmonDuplicateDataShards", L, "warning",
            f"count {c.by_run} (\n  {identical()}\n)",
            c.data_duplicate_for,
            "Ranks are training on identical batches; data shards are duplicated.",
            f"{RUN}: {{{{ $value }}}} rank(s) computed local gradients bit-identical "
            "to another rank's at sampled steps of the last "
            f"{c.data_duplicate_window}, so they were fed the same batches. Ranks: "
            f"{rank_list(identical(BY_RUN), c, worst_first=False)}.",
        ),
        Alert(
            "DdpmonDataStarved", L, "warning",
            f"{n.DATA_WAIT_MEAN}\n> {c.on_run} group_left ()\n"
            f"({c.data_starved_factor:g} * {n.DATA_WAIT_RUN_MEDIAN})\n"
            f"and\n{n.DATA_WAIT_RATIO} > {c.data_starved_share:g}",
            c.data_starved_for,
            "A rank waits for data much longer than the others and holds the run back.",
            f"{RANK} waits {{{{ $value | humanizeDuration }}}} per step for its next batch, "
            f"more than {c.data_starved_factor:g}x the run's median rank and over "
            f"{c.data_starved_share:.0%} of its iterations; its input pipeline cannot keep up "
            "and the other ranks wait for it in the all-reduce.",
        ),
    ]
