"""Queries of the overview's "Goodput and throughput" row (docs/goodput.md): rank 0's goodput
series for the run, the ruler's run throughput records, and the ranks with the lowest MFU."""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.mixin import names as n
from ddpmon.mixin.dashboards.promql import gauge_top

# rank 0 exports the run's goodput; a restart's new rank 0 carries it on (max by run)
BUCKET_SHARES = (
    f"max by (run, bucket) ({m.GOODPUT_SECONDS.name}{{R}})\n"
    f"/ on (run) group_left () max by (run) ({m.GOODPUT_WALL.name}{{R}})"
)
GOODPUT = f"max by (run) ({m.GOODPUT_RATIO.name}{{R}})"
ETTR = f"max by (run) ({m.GOODPUT_ETTR.name}{{R}})"
WALL = f"max by (run) ({m.GOODPUT_WALL.name}{{R}})"
TOKENS_RUN = f"max by (run) ({n.TOKENS_RUN_RATE}{{RR}})"
FLOPS_RUN = f"max by (run) ({n.ACHIEVED_FLOPS_RUN}{{RR}})"
MFU_RUN = f"max by (run) ({n.MFU_RUN}{{RR}})"
MFU_LOWEST = gauge_top("bottomk", m.MFU.name)
TOKENS_LOWEST = gauge_top("bottomk", m.TOKENS_PER_SECOND.name)
