"""Layout of the overview's "Goodput and throughput" row: where the run's wall-clock time went
(goodput buckets, ETTR) and how well its steps used the hardware (tokens/s, FLOP/s, MFU).

The PromQL lives in :mod:`.queries.goodput`; this module only places it.
"""

from __future__ import annotations

from typing import Any

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.model import RUN, PanelSpec, RowSpec
from ddpmon.mixin.dashboards.queries import goodput as Q


def row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Goodput and throughput",
        (
            PanelSpec(
                "Goodput and ETTR", "timeseries", "percentunit",
                (q(Q.GOODPUT, "goodput", RUN), q(Q.ETTR, "ETTR", RUN)),
                "Productive step time (steps whose progress was kept) over the run's wall-clock "
                "time since its first start, every attempt counted; ETTR adds the kept steps' "
                "data wait, warm-up and marked phases (Kokolis et al. 2025). Rank 0 recomputes "
                f"both every goodput_seconds; DdpmonGoodputLow below {cfg.goodput_floor:.0%}.",
                thresholds=((cfg.goodput_floor, "green"),), base_color="red",
            ),
            PanelSpec(
                "Where the wall-clock time went", "timeseries", "percentunit",
                (q(Q.BUCKET_SHARES, "{{bucket}}", RUN),),
                "Each goodput bucket's share of the wall-clock time (Google's bucket names: "
                "productive, wasted_progress_from_disruption, initialization, "
                "data_loading_sync, unproductive_checkpoint_save, restart_gap, ...); they add "
                "up to 100%. `ddpmon timeline` and `ddpmon report` break them down by attempt.",
            ),
            PanelSpec(
                "Run tokens/s", "timeseries", "short",
                (q(Q.TOKENS_RUN, "run", RUN), q(Q.TOKENS_LOWEST, "slowest {{rank}}")),
                "Tokens (or samples) the run processes per second: its ranks' added up by the "
                "ruler; and the k ranks with the lowest rate. Ranks that share a batch "
                "(tensor or pipeline parallel) each count it.",
                rank_links=True,
            ),
            PanelSpec(
                "Run FLOP/s and MFU", "timeseries", "percentunit",
                (q(Q.MFU_RUN, "run MFU", RUN), q(Q.MFU_LOWEST, "lowest {{rank}}")),
                "Model FLOPs utilisation: the run's achieved FLOP/s over its ranks' peaks "
                "(FLOPs per step counted by FlopCounterMode on one step, or given), and the k "
                "ranks with the lowest. A rank whose figure would exceed 100% exports none and "
                "is left out of the run's.",
                rank_links=True,
            ),
            PanelSpec(
                "Run achieved FLOP/s", "stat", "short",
                (q(Q.FLOPS_RUN, "FLOP/s", RUN, instant=True),),
                "FLOP/s the run's ranks achieve together (FLOPs per step x steps/s, summed).",
                width=6, height=5,
            ),
            PanelSpec(
                "Wall-clock time", "stat", "s",
                (q(Q.WALL, "wall", RUN, instant=True),),
                "The run's wall-clock time from its first attempt's first process start, "
                "restarts and requeues included: what the goodput shares divide.",
                width=6, height=5,
            ),
        ),
    )
