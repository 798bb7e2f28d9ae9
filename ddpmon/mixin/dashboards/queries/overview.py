"""Queries of "ddpmon / Run overview", by row. Templates: see :mod:`..promql` placeholders."""

from __future__ import annotations

from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR, gauge_top, ranked, rate_top

# --- Run ---
REPORTING_RATIO = "count by (run) (ddpmon_rank_info{R}) / max by (run) (ddpmon_world_size{R})"
DOWN_RANKS = 'max by (rank, instance) (up{R}) == 0'
MISSING_RANKS = (
    "group by (rank) (last_over_time(ddpmon_world_size{R}[$__range])) "
    "unless on (rank) group by (rank) (ddpmon_world_size{R})"
)
AGENT_ERRORS = "sum(increase(ddpmon_agent_errors_total{R}[$__range] @ end())) or vector(0)"
VERSIONS = (
    "count by (version, torch_version, cuda_version, nccl_version, python_version) "
    "(ddpmon_build_info{R})"
)
STEP_LEADER = f"max by (run) ({n.STEP_LEADER}{{RR}})"
STEP_SLOWEST = "min by (run) (ddpmon_step{R})"
HEARTBEAT_AGE = f"max by (run) ({n.HEARTBEAT_AGE}{{RR}})"
FIRING_ALERTS = f"count(ALERTS{{{ALERT_SELECTOR}}}) or vector(0)"


def _problem(name: str, expr: str) -> str:
    return f'label_replace({expr}, "problem", "{name}", "", "")'


def rank_health(cfg: MixinConfig) -> dict[str, str]:
    """Instant queries of the rank-health table, one value per rank each (refId -> query)."""
    behind = f"max by (rank) ({n.STEP_LEADER}{{RR}} - on (run) group_right ddpmon_step{{S}})"
    skew = (
        f"max by (rank) ({n.COMPUTE_MEAN}{{SR}} / on (run) group_left "
        f"quantile by (run) (0.5, {n.COMPUTE_MEAN}{{RR}}))"
    )
    age = f"max by (rank) ({n.HEARTBEAT_AGE}{{SR}})"
    stalled = (
        f"max by (rank) ({n.HEARTBEAT_AGE}{{SR}} > {n.STALL_THRESHOLD}{{SR}})"
    )
    share = f"max by (rank) ({n.DATA_WAIT_RATIO}{{SR}})"
    used = f"max by (rank) ({n.GPU_ALLOCATED_RATIO}{{SR}})"
    up = "max by (rank) (up{S})"
    problems = " or ".join(
        (
            _problem("down", f"{up} == 0"),
            _problem("stalled", stalled),
            _problem("behind", f"{behind} > {cfg.rank_desync_steps:g}"),
            _problem("straggler", f"{skew} > {cfg.straggler_ratio:g}"),
            _problem("starved", f"{share} > {cfg.data_starved_share:g}"),
            _problem("memory", f"{used} > {cfg.gpu_memory_full_ratio:g}"),
        )
    )
    return {
        "A": f"count by (rank) ({problems}) or max by (rank) (ddpmon_step{{S}}) * 0",
        "B": up,
        "C": age,
        "D": behind,
        "E": skew,
        "F": share,
        "G": f"1 - {used}",
        "H": f'count by (rank) (ALERTS{{{ALERT_SELECTOR}, rank=~"$rank", rank!=""}})',
    }

# --- Numerics ---
LOSS_MEDIAN = "quantile by (run) (0.5, ddpmon_loss{R})"
LOSS_TOP = gauge_top("topk", "ddpmon_loss")
GRAD_NORM_RUN = f"{n.GRAD_NORM_RUN_MAX}{{RR}}"
GRAD_NORM_SPREAD = f"{n.GRAD_NORM_RUN_SPREAD}{{RR}}"
LOCAL_NORM_MEDIAN = "quantile by (run) (0.5, ddpmon_grad_local_norm{R})"
LOCAL_NORM_TOP = gauge_top("topk", "ddpmon_grad_local_norm")
NONFINITE_REDUCED = (
    "max by (run) (increase(ddpmon_grad_nonfinite_steps_total{S}[$__rate_interval]))"
)
NONFINITE_ORIGIN = (
    "sum by (run) (increase(ddpmon_grad_nonfinite_origin_steps_total{S}[$__rate_interval]))"
)
NONFINITE_LOSS = "sum by (run) (increase(ddpmon_loss_nonfinite_total{S}[$__rate_interval]))"
ORIGIN_TABLE = (
    "max by (rank, step, param, kind) "
    "(last_over_time(ddpmon_grad_first_nonfinite_info{S}[$__range]))"
)
LOSS_SCALE_LOWEST = gauge_top("bottomk", "ddpmon_amp_loss_scale")
LOSS_SCALE_FLOOR = "min by (run) (ddpmon_amp_loss_scale_floor{R})"
SKIPPED_TOP = gauge_top("topk", n.SKIPPED_RATIO, "{SR}")

# --- Data supply ---
DATA_WAIT_MEDIAN = f"quantile by (run) (0.5, {n.DATA_WAIT_MEAN}{{RR}})"
DATA_WAIT_TOP = gauge_top("topk", n.DATA_WAIT_MEAN, "{SR}")
DATA_WAIT_HEATMAP = f"{n.DATA_WAIT_MEAN}{{SR}}"
STEPS_RATE_MEDIAN = f"quantile by (run) (0.5, {n.STEPS_RATE}{{RR}})"
STEPS_RATE_SLOWEST = gauge_top("bottomk", n.STEPS_RATE, "{SR}")
STEP_P99_HEATMAP = f"{n.STEP_P99}{{SR}}"
IDENTICAL_RANKS = (
    "count by (run) (changes(ddpmon_data_identical_batches_total{R}[$__range] @ end()) > 0) "
    "or vector(0)"
)
IDENTICAL_TOP = ranked(
    "topk",
    "increase(ddpmon_data_identical_batches_total{S}[$__rate_interval])",
    "increase(ddpmon_data_identical_batches_total{S}[$__range] @ end()) > 0",
)

# --- Memory ---
RESERVED_TOP = gauge_top("topk", "ddpmon_cuda_memory_reserved_bytes")
ALLOCATED_TOP = gauge_top("topk", "ddpmon_cuda_memory_allocated_bytes")
PEAK_TOP = gauge_top("topk", "ddpmon_cuda_memory_peak_allocated_bytes")
DEVICE_TOTAL = "max by (run) (ddpmon_gpu_memory_total_bytes{S})"
DEVICE_USED_TOP = gauge_top("topk", "ddpmon_gpu_memory_used_bytes")
HEADROOM_TIGHTEST = ranked(
    "bottomk",
    f"1 - {n.GPU_ALLOCATED_RATIO}{{SR}}",
    f"1 - max_over_time({n.GPU_ALLOCATED_RATIO}{{SR}}[$__range] @ end())",
)
OOMS = "sum by (run) (increase(ddpmon_cuda_ooms_total{S}[$__rate_interval]))"
RETRIES = "sum by (run) (increase(ddpmon_cuda_alloc_retries_total{S}[$__rate_interval]))"
RSS_MEDIAN = "quantile by (run) (0.5, ddpmon_process_resident_memory_bytes{R})"
RSS_TOP = gauge_top("topk", "ddpmon_process_resident_memory_bytes")

# --- Communication ---
ALLREDUCE_P50_HEATMAP = f"{n.ALLREDUCE_P50}{{SR}}"
ALLREDUCE_P99_HEATMAP = f"{n.ALLREDUCE_P99}{{SR}}"
ALLREDUCE_P99_BY_NODE = (
    f"max by (node) ({n.ALLREDUCE_P99}{{SR}}) and on (node) "
    f"topk({{K}}, max by (node) (max_over_time({n.ALLREDUCE_P99}{{SR}}[$__range] @ end())))"
)
ALLREDUCE_P50_MEDIAN = f"quantile by (run) (0.5, {n.ALLREDUCE_P50}{{RR}})"
ALLREDUCE_P99_MEDIAN = f"quantile by (run) (0.5, {n.ALLREDUCE_P99}{{RR}})"
ALLREDUCE_RUN_P99 = f"{n.ALLREDUCE_RUN_P99}{{RR}}"
ALLREDUCE_P99_TOP = gauge_top("topk", n.ALLREDUCE_P99, "{SR}")
ALLREDUCE_P50_TOP = gauge_top("topk", n.ALLREDUCE_P50, "{SR}")
ALLREDUCE_BYTES = "sum by (run) (rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval]))"
ALLREDUCE_BYTES_TOP = rate_top("topk", "rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval])")
COMPUTE_SKEW_TOP = ranked(
    "topk",
    f"{n.COMPUTE_MEAN}{{SR}} / on (run) group_left "
    f"quantile by (run) (0.5, {n.COMPUTE_MEAN}{{RR}})",
    f"max_over_time({n.COMPUTE_MEAN}{{SR}}[$__range] @ end())",
)
STEP_DRIFT = f"max by (run) ({n.STEP_LEADER}{{RR}}) - min by (run) (ddpmon_step{{R}})"
STEP_BEHIND_TOP = ranked(
    "bottomk",
    f"max by (run) ({n.STEP_LEADER}{{RR}}) - on (run) group_right ddpmon_step{{S}}",
    "last_over_time(ddpmon_step{S}[$__range] @ end())",
)
