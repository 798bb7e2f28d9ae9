"""Queries of "ddpmon / Rank detail", by row. Templates: see :mod:`..promql` placeholders."""

from __future__ import annotations

from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.promql import hq

# --- Rank ---
IDENTITY = (
    "max by (rank, local_rank, world_size, node, backend, device, gpu_uuid, pid) "
    "(ddpmon_rank_info{D})"
)
COLLECTORS = "ddpmon_collector_success{D}"
UP = "max by (rank) (up{D})"
BUILD = (
    "max by (version, torch_version, cuda_version, nccl_version, python_version) "
    "(ddpmon_build_info{D})"
)
AGENT_ERRORS = "sum by (probe) (increase(ddpmon_agent_errors_total{D}[$__rate_interval]))"

# --- Numerics ---
LOSS = "ddpmon_loss{D}"
LOSS_MEDIAN = "quantile by (run) (0.5, ddpmon_loss{R})"
GRAD_NORM = "ddpmon_grad_norm{D}"
LOCAL_NORM = "ddpmon_grad_local_norm{D}"
GROUP_NORM_TOP = (
    "ddpmon_grad_group_norm{D} and on (group) topk({K}, "
    "max_over_time(ddpmon_grad_group_norm{D}[$__range] @ end()))"
)
LOSS_SCALE = "ddpmon_amp_loss_scale{D}"
LOSS_SCALE_FLOOR = "ddpmon_amp_loss_scale_floor{D}"
NONFINITE_REDUCED = "increase(ddpmon_grad_nonfinite_steps_total{D}[$__rate_interval])"
NONFINITE_ORIGIN = "increase(ddpmon_grad_nonfinite_origin_steps_total{D}[$__rate_interval])"
NONFINITE_LOSS = "increase(ddpmon_loss_nonfinite_total{D}[$__rate_interval])"
SKIPPED = "increase(ddpmon_amp_skipped_steps_total{D}[$__rate_interval])"
FIRST_NONFINITE = (
    "max by (rank, step, param, kind) "
    "(last_over_time(ddpmon_grad_first_nonfinite_info{D}[$__range]))"
)

# --- Data supply ---
STEP_P50 = hq(0.5, "ddpmon_step_duration_seconds", "rank", "{D}")
STEP_P99 = hq(0.99, "ddpmon_step_duration_seconds", "rank", "{D}")
STEP_P99_MEDIAN = f"quantile by (run) (0.5, {n.STEP_P99}{{RR}})"
DATA_WAIT_P50 = hq(0.5, "ddpmon_data_wait_seconds", "rank", "{D}")
DATA_WAIT_P99 = hq(0.99, "ddpmon_data_wait_seconds", "rank", "{D}")
DATA_WAIT_MEDIAN = f"quantile by (run) (0.5, {n.DATA_WAIT_MEAN}{{RR}})"
STEPS_RATE = f"{n.STEPS_RATE}{{DR}}"
STEPS_RATE_MEDIAN = f"quantile by (run) (0.5, {n.STEPS_RATE}{{RR}})"

# --- Memory ---
RESERVED = "ddpmon_cuda_memory_reserved_bytes{D}"
ALLOCATED = "ddpmon_cuda_memory_allocated_bytes{D}"
PEAK = "ddpmon_cuda_memory_peak_allocated_bytes{D}"
DEVICE_TOTAL = "ddpmon_gpu_memory_total_bytes{D}"
DEVICE_USED = "ddpmon_gpu_memory_used_bytes{D}"
ALLOC_RETRIES = "increase(ddpmon_cuda_alloc_retries_total{D}[$__rate_interval])"
OOMS = "increase(ddpmon_cuda_ooms_total{D}[$__rate_interval])"
RSS = "ddpmon_process_resident_memory_bytes{D}"
RSS_MEDIAN = "quantile by (run) (0.5, ddpmon_process_resident_memory_bytes{R})"
CPU = "rate(ddpmon_process_cpu_seconds_total{D}[$__rate_interval])"

# --- Communication ---
ALLREDUCE_P50 = hq(0.5, "ddpmon_allreduce_duration_seconds", "rank", "{D}")
ALLREDUCE_P99 = hq(0.99, "ddpmon_allreduce_duration_seconds", "rank", "{D}")
ALLREDUCE_RUN_P99 = f"{n.ALLREDUCE_RUN_P99}{{RR}}"
ALLREDUCE_BYTES = "rate(ddpmon_allreduce_bytes_total{D}[$__rate_interval])"
COMPUTE_SKEW = (
    f"{n.COMPUTE_MEAN}{{DR}} / on (run) group_left "
    f"quantile by (run) (0.5, {n.COMPUTE_MEAN}{{RR}})"
)
STEPS_BEHIND = f"max by (run) ({n.STEP_LEADER}{{RR}}) - on (run) group_right ddpmon_step{{D}}"

# --- GPU ---
GPU_UTIL = "ddpmon_gpu_utilization_ratio{D}"
GPU_TEMP = "ddpmon_gpu_temperature_celsius{D}"
GPU_POWER = "ddpmon_gpu_power_watts{D}"


def dcgm(metric: str, cfg: MixinConfig) -> str:
    """A dcgm-exporter series of the rank's GPU, joined by ``gpu_uuid`` = ``UUID``; restricted
    by ``MixinConfig.dashboard_dcgm_selector`` when set."""
    matchers = f"{{{cfg.dashboard_dcgm_selector}}}" if cfg.dashboard_dcgm_selector.strip() else ""
    return (
        f"{metric}{matchers} * on (UUID) group_left (run, rank) "
        'label_replace(ddpmon_rank_info{D}, "UUID", "$1", "gpu_uuid", "(.+)")'
    )
