"""Queries of "ddpmon / Run overview", by row. Templates: see :mod:`..promql` placeholders."""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR, gauge_top, ranked, ranks_of, rate_top
from ddpmon.mixin.stragglers import TARGET

# --- Run ---
REPORTING_RATIO = (
    f"count by (run) ({m.RANK_INFO.name}{{R}}) / max by (run) ({m.WORLD_SIZE.name}{{R}})"
)
DOWN_RANKS = 'max by (rank, instance) (up{R}) == 0'
MISSING_RANKS = (
    f"group by (rank) (last_over_time({m.WORLD_SIZE.name}{{R}}[$__range])) "
    f"unless on (rank) group by (rank) ({m.WORLD_SIZE.name}{{R}})"
)
AGENT_ERRORS = f"sum(increase({m.AGENT_ERRORS.name}{{R}}[$__range] @ end())) or vector(0)"
VERSIONS = (
    "count by (version, torch_version, cuda_version, nccl_version, python_version) "
    f"({m.BUILD_INFO.name}{{R}})"
)
STEP_LEADER = f"max by (run) ({n.STEP_LEADER}{{RR}})"
STEP_SLOWEST = f"min by (run) ({n.STEP_RUN_MIN}{{RR}})"
HEARTBEAT_AGE = f"max by (run) ({n.HEARTBEAT_AGE}{{RR}})"
FIRING_ALERTS = f"count(ALERTS{{{ALERT_SELECTOR}}}) or vector(0)"


def rank_health(cfg: MixinConfig) -> dict[str, str]:
    """Instant queries of the rank-health table, one value per rank each (refId -> query)."""
    behind = f"max by (rank) ({n.STEP_LEADER}{{RR}} - on (run) group_right {m.STEP.name}{{S}})"
    skew = f"max by (rank) ({n.STRAGGLER_SLOWDOWN}{{SR}})"
    age = f"max by (rank) ({n.HEARTBEAT_AGE}{{SR}})"
    share = f"max by (rank) ({n.DATA_WAIT_RATIO}{{SR}})"
    used = f"max by (rank) ({n.GPU_ALLOCATED_RATIO}{{SR}})"
    up = "max by (rank) (up{S})"
    return {
        # Recorded by the ruler (the same problems and thresholds, see rules.rank_problems).
        "A": f"max by (rank) ({n.RANK_PROBLEMS}{{SR}})",
        "B": up,
        "C": age,
        "D": behind,
        "E": skew,
        "F": share,
        "G": f"1 - {used}",
        "H": f'count by (rank) (ALERTS{{{ALERT_SELECTOR}, rank=~"$rank", rank!=""}})',
    }

# --- Numerics ---
LOSS_MEDIAN = f"max by (run) ({n.LOSS_RUN_MEDIAN}{{RR}})"
LOSS_TOP = gauge_top("topk", f"{m.LOSS.name}")
GRAD_NORM_RUN = f"{n.GRAD_NORM_RUN_MAX}{{RR}}"
GRAD_NORM_SPREAD = f"{n.GRAD_NORM_RUN_SPREAD}{{RR}}"
LOCAL_NORM_MEDIAN = f"max by (run) ({n.LOCAL_NORM_RUN_MEDIAN}{{RR}})"
LOCAL_NORM_TOP = gauge_top("topk", f"{m.GRAD_LOCAL_NORM.name}")
NONFINITE_REDUCED = (
    f"max by (run) (increase({m.GRAD_NONFINITE_STEPS.name}{{S}}[$__rate_interval]))"
)
NONFINITE_ORIGIN = (
    f"sum by (run) (increase({m.GRAD_NONFINITE_ORIGIN_STEPS.name}{{S}}[$__rate_interval]))"
)
NONFINITE_LOSS = f"sum by (run) (increase({m.LOSS_NONFINITE.name}{{S}}[$__rate_interval]))"
ORIGIN_TABLE = (
    "max by (rank, step, param, kind) "
    f"(last_over_time({m.GRAD_FIRST_NONFINITE_INFO.name}{{S}}[$__range]))"
)
LOSS_SCALE_LOWEST = gauge_top("bottomk", f"{m.AMP_LOSS_SCALE.name}")
LOSS_SCALE_FLOOR = f"min by (run) ({m.AMP_LOSS_SCALE_FLOOR.name}{{R}})"
SKIPPED_TOP = gauge_top("topk", n.SKIPPED_RATIO, "{SR}")

# --- Data supply ---
DATA_WAIT_MEDIAN = f"max by (run) ({n.DATA_WAIT_RUN_MEDIAN}{{RR}})"
DATA_WAIT_TOP = gauge_top("topk", n.DATA_WAIT_MEAN, "{SR}")
DATA_WAIT_HEATMAP = f"max by (le) ({n.DATA_WAIT_RANKS}{{RR}})"
STEPS_RATE_MEDIAN = f"max by (run) ({n.STEPS_RATE_RUN_MEDIAN}{{RR}})"
STEPS_RATE_SLOWEST = gauge_top("bottomk", n.STEPS_RATE, "{SR}")
STEP_P99_HEATMAP = f"max by (le) ({n.STEP_P99_RANKS}{{RR}})"
IDENTICAL_RANKS = (
    f"count by (run) (changes({m.DATA_IDENTICAL_BATCHES.name}{{R}}[$__range] @ end()) > 0) "
    "or vector(0)"
)
IDENTICAL_TOP = ranked(
    "topk",
    f"increase({m.DATA_IDENTICAL_BATCHES.name}{{S}}[$__rate_interval])",
    f"increase({m.DATA_IDENTICAL_BATCHES.name}{{S}}[$__range] @ end()) > 0",
)

# --- Memory ---
RESERVED_TOP = gauge_top("topk", f"{m.CUDA_MEMORY_RESERVED.name}")
ALLOCATED_TOP = gauge_top("topk", f"{m.CUDA_MEMORY_ALLOCATED.name}")
PEAK_TOP = gauge_top("topk", f"{m.CUDA_MEMORY_PEAK_ALLOCATED.name}")
DEVICE_TOTAL = f"max by (run) ({m.GPU_MEMORY_TOTAL.name}{{S}})"
DEVICE_USED_TOP = gauge_top("topk", f"{m.GPU_MEMORY_USED.name}")
# the tightest headroom = the highest allocated share over the range
HEADROOM_TIGHTEST = "1 - " + ranks_of(
    "topk",
    f"{n.GPU_ALLOCATED_RATIO}{{SR}}",
    f"max_over_time({n.GPU_ALLOCATED_RATIO}{{SR}}[$__range] @ end())",
)
OOMS = f"sum by (run) (increase({m.CUDA_OOMS.name}{{S}}[$__rate_interval]))"
RETRIES = f"sum by (run) (increase({m.CUDA_ALLOC_RETRIES.name}{{S}}[$__rate_interval]))"
RSS_MEDIAN = f"max by (run) ({n.RSS_RUN_MEDIAN}{{RR}})"
RSS_TOP = gauge_top("topk", f"{m.PROCESS_RESIDENT_MEMORY.name}")

# --- Communication ---
# Entries (rank, op) per bucket: the ruler's per-op counts summed over the ops.
COLLECTIVE_MEAN_HEATMAP = f"sum by (le) ({n.COLLECTIVE_MEAN_RANKS}{{RR}})"
COLLECTIVE_P99_HEATMAP = f"sum by (le) ({n.COLLECTIVE_P99_RANKS}{{RR}})"
COLLECTIVE_MEAN_BY_NODE = (
    f"max by (node, op) ({n.COLLECTIVE_MEAN}{{SR}}) and on (node) "
    f"topk({{K}}, max by (node) (max_over_time({n.COLLECTIVE_MEAN}{{SR}}[$__range] @ end())))"
)
COLLECTIVE_MEAN_MEDIAN = f"max by (run, op) ({n.COLLECTIVE_MEAN_RUN_MEDIAN}{{RR}})"
COLLECTIVE_P99_MEDIAN = f"max by (run, op) ({n.COLLECTIVE_P99_RUN_MEDIAN}{{RR}})"
COLLECTIVE_RUN_P99 = f"{n.COLLECTIVE_RUN_P99}{{RR}}"
COLLECTIVE_MEAN_TOP = gauge_top("topk", n.COLLECTIVE_MEAN, "{SR}")
COLLECTIVE_BYTES = (
    f"sum by (run, op) (rate({m.COLLECTIVE_BYTES.name}{{S}}[$__rate_interval]))"
)
COLLECTIVE_BYTES_TOP = rate_top(
    "topk", f"rate({m.COLLECTIVE_BYTES.name}{{S}}[$__rate_interval])"
)
SLOWDOWN_TOP = ranks_of(
    "topk",
    f"{n.STRAGGLER_SLOWDOWN}{{SR}}",
    f"max_over_time({n.STRAGGLER_SLOWDOWN}{{SR}}[$__range] @ end())",
)
"""The k ranks slowest at the range's end (own time over the run's median rank's, less one)."""
STRAGGLER_TABLE = (
    f"sort_desc(topk(10, {n.STRAGGLER_SLOWDOWN}{{SR}} * {TARGET} group_left (cause) "
    f"({n.STRAGGLER_CAUSE}{{SR}} * 0 + 1)))"
)
"""The 10 slowest ranks now, slowest first, with their cause."""
STEP_DRIFT = f"max by (run) ({n.STEP_LEADER}{{RR}}) - min by (run) ({n.STEP_RUN_MIN}{{RR}})"
# "group_right ()": a parenthesis right after group_right would be read as its label list
STEP_BEHIND_TOP = f"max by (run) ({n.STEP_LEADER}{{RR}}) - on (run) group_right () " + ranks_of(
    "bottomk",
    f"{m.STEP.name}{{S}}",
    f"last_over_time({m.STEP.name}{{S}}[$__range] @ end())",
)
