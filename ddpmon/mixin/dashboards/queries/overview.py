"""Queries of "ddpmon / Run overview", by row. Templates: see :mod:`..promql` placeholders."""

from __future__ import annotations

from ddpmon.mixin import names as n
from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR, gauge_top, ranked, rate_top

# --- Run ---
RANKS_REPORTING = "count by (run) (ddpmon_rank_info{R})"
WORLD_SIZE = "max by (run) (ddpmon_world_size{R})"
STEP_LEADER = "max by (run) (ddpmon_step{R})"
STEP_SLOWEST = "min by (run) (ddpmon_step{R})"
HEARTBEAT_AGE = "time() - min by (run) (ddpmon_last_step_timestamp_seconds{R})"
FIRING_ALERTS = f"count(ALERTS{{{ALERT_SELECTOR}}}) or vector(0)"
RANK_TABLE = (
    "max by (rank, local_rank, node, device, gpu_uuid, backend, pid) (ddpmon_rank_info{S})"
)

# --- Numerics ---
LOSS_MEDIAN = "quantile by (run) (0.5, ddpmon_loss{R})"
LOSS_TOP = gauge_top("topk", "ddpmon_loss")
GRAD_NORM_TOP = gauge_top("topk", "ddpmon_grad_norm")
GRAD_NORM_BOTTOM = gauge_top("bottomk", "ddpmon_grad_norm")
LOCAL_NORM_MEDIAN = "quantile by (run) (0.5, ddpmon_grad_local_norm{R})"
LOCAL_NORM_TOP = gauge_top("topk", "ddpmon_grad_local_norm")
LOCAL_NORM_BOTTOM = gauge_top("bottomk", "ddpmon_grad_local_norm")
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
LOSS_SCALE_TOP = gauge_top("topk", "ddpmon_amp_loss_scale")
LOSS_SCALE_BOTTOM = gauge_top("bottomk", "ddpmon_amp_loss_scale")
LOSS_SCALE_FLOOR = "min by (run) (ddpmon_amp_loss_scale_floor{R})"
SKIPPED_TOP = rate_top(
    "topk",
    "rate(ddpmon_amp_skipped_steps_total{S}[$__rate_interval]) "
    "/ rate(ddpmon_steps_total{S}[$__rate_interval])",
)

# --- Data supply ---
DATA_WAIT_MEDIAN = f"quantile by (run) (0.5, {n.DATA_WAIT_MEAN}{{RR}})"
DATA_WAIT_TOP = gauge_top("topk", n.DATA_WAIT_MEAN, "{SR}")
DATA_WAIT_HEATMAP = f"{n.DATA_WAIT_MEAN}{{SR}}"
STEPS_RATE_MEDIAN = "quantile by (run) (0.5, rate(ddpmon_steps_total{R}[$__rate_interval]))"
STEPS_RATE_SLOWEST = rate_top("bottomk", "rate(ddpmon_steps_total{S}[$__rate_interval])")
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
    "topk",
    "1 - ddpmon_gpu_memory_used_bytes{S} / ddpmon_gpu_memory_total_bytes{S}",
    "max_over_time(ddpmon_gpu_memory_used_bytes{S}[$__range] @ end()) "
    "/ ddpmon_gpu_memory_total_bytes{S} @ end()",
)
OOMS = "sum by (run) (increase(ddpmon_cuda_ooms_total{S}[$__rate_interval]))"
RSS_MEDIAN = "quantile by (run) (0.5, ddpmon_process_resident_memory_bytes{R})"
RSS_TOP = gauge_top("topk", "ddpmon_process_resident_memory_bytes")

# --- Communication ---
ALLREDUCE_P50_HEATMAP = f"{n.ALLREDUCE_P50}{{SR}}"
ALLREDUCE_P99_HEATMAP = f"{n.ALLREDUCE_P99}{{SR}}"
ALLREDUCE_P50_MEDIAN = f"quantile by (run) (0.5, {n.ALLREDUCE_P50}{{RR}})"
ALLREDUCE_P99_MEDIAN = f"quantile by (run) (0.5, {n.ALLREDUCE_P99}{{RR}})"
ALLREDUCE_RUN_P99 = f"{n.ALLREDUCE_RUN_P99}{{RR}}"
ALLREDUCE_P99_TOP = gauge_top("topk", n.ALLREDUCE_P99, "{SR}")
ALLREDUCE_P50_TOP = gauge_top("topk", n.ALLREDUCE_P50, "{SR}")
ALLREDUCE_BYTES = "sum by (run) (rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval]))"
ALLREDUCE_BYTES_TOP = rate_top("topk", "rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval])")
STEP_SKEW_TOP = ranked(
    "topk",
    f"{n.STEP_MEAN}{{SR}} / on (run) group_left quantile by (run) (0.5, {n.STEP_MEAN}{{RR}})",
    f"max_over_time({n.STEP_MEAN}{{SR}}[$__range] @ end())",
)
STEP_DRIFT = "max by (run) (ddpmon_step{R}) - min by (run) (ddpmon_step{R})"
STEP_BEHIND_TOP = ranked(
    "bottomk",
    "max by (run) (ddpmon_step{R}) - on (run) group_right ddpmon_step{S}",
    "last_over_time(ddpmon_step{S}[$__range] @ end())",
)
