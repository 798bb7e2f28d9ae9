"""Queries of "ddpmon / Rank detail", by row. Templates: see :mod:`..promql` placeholders."""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.promql import hq

# --- Rank ---
IDENTITY = (
    "max by (rank, local_rank, world_size, node, backend, device, gpu_uuid, pid) "
    f"({m.RANK_INFO.name}{{D}})"
)
COLLECTORS = f"{m.COLLECTOR_SUCCESS.name}{{D}}"
UP = "max by (rank) (up{D})"
BUILD = (
    "max by (version, torch_version, cuda_version, nccl_version, python_version) "
    f"({m.BUILD_INFO.name}{{D}})"
)
AGENT_ERRORS = f"sum by (probe) (increase({m.AGENT_ERRORS.name}{{D}}[$__rate_interval]))"

# --- Numerics ---
LOSS = f"{m.LOSS.name}{{D}}"
LOSS_MEDIAN = f"max by (run) ({n.LOSS_RUN_MEDIAN}{{RR}})"
GRAD_NORM = f"{m.GRAD_NORM.name}{{D}}"
LOCAL_NORM = f"{m.GRAD_LOCAL_NORM.name}{{D}}"
_GROUP = m.GRAD_GROUP_NORM.name
GROUP_NORM_TOP = (
    # The reduced group norms are the same on every rank; under series_profile=large only
    # rank 0 exports them, so a rank that had none of its own in the range shows rank 0's
    # (never both: a rank scraped a moment after rank 0 must not draw rank 0's for a step).
    f"({_GROUP}{{D}} or on (group) ({_GROUP}{{D0}} unless on (group) "
    f"max_over_time({_GROUP}{{D}}[$__range] @ end()))) and on (group) topk({{K}}, "
    f"max_over_time({_GROUP}{{D}}[$__range] @ end()) or on (group) "
    f"max_over_time({_GROUP}{{D0}}[$__range] @ end()))"
)
LOSS_SCALE = f"{m.AMP_LOSS_SCALE.name}{{D}}"
LOSS_SCALE_FLOOR = f"{m.AMP_LOSS_SCALE_FLOOR.name}{{D}}"
NONFINITE_REDUCED = f"increase({m.GRAD_NONFINITE_STEPS.name}{{D}}[$__rate_interval])"
NONFINITE_ORIGIN = f"increase({m.GRAD_NONFINITE_ORIGIN_STEPS.name}{{D}}[$__rate_interval])"
NONFINITE_LOSS = f"increase({m.LOSS_NONFINITE.name}{{D}}[$__rate_interval])"
SKIPPED = f"sum by (rank, by) (increase({m.STEPS_SKIPPED.name}{{D}}[$__rate_interval]))"
FIRST_NONFINITE = (
    "max by (rank, step, param, kind) "
    f"(last_over_time({m.GRAD_FIRST_NONFINITE_INFO.name}{{D}}[$__range]))"
)

# --- Data supply ---
STEP_P50 = hq(0.5, f"{m.STEP_DURATION.name}", "rank", "{D}")
STEP_P99 = hq(0.99, f"{m.STEP_DURATION.name}", "rank", "{D}")
STEP_P99_MEDIAN = f"max by (run) ({n.STEP_P99_RUN_MEDIAN}{{RR}})"
DATA_WAIT_P50 = hq(0.5, f"{m.DATA_WAIT.name}", "rank", "{D}")
DATA_WAIT_P99 = hq(0.99, f"{m.DATA_WAIT.name}", "rank", "{D}")
DATA_WAIT_MEDIAN = f"max by (run) ({n.DATA_WAIT_RUN_MEDIAN}{{RR}})"
STEPS_RATE = f"{n.STEPS_RATE}{{DR}}"
STEPS_RATE_MEDIAN = f"max by (run) ({n.STEPS_RATE_RUN_MEDIAN}{{RR}})"

# --- Memory ---
RESERVED = f"{m.CUDA_MEMORY_RESERVED.name}{{D}}"
ALLOCATED = f"{m.CUDA_MEMORY_ALLOCATED.name}{{D}}"
PEAK = f"{m.CUDA_MEMORY_PEAK_ALLOCATED.name}{{D}}"
DEVICE_TOTAL = f"{m.GPU_MEMORY_TOTAL.name}{{D}}"
DEVICE_USED = f"{m.GPU_MEMORY_USED.name}{{D}}"
ALLOC_RETRIES = f"increase({m.CUDA_ALLOC_RETRIES.name}{{D}}[$__rate_interval])"
OOMS = f"increase({m.CUDA_OOMS.name}{{D}}[$__rate_interval])"
RSS = f"{m.PROCESS_RESIDENT_MEMORY.name}{{D}}"
RSS_MEDIAN = f"max by (run) ({n.RSS_RUN_MEDIAN}{{RR}})"
CPU = f"rate({m.PROCESS_CPU_SECONDS.name}{{D}}[$__rate_interval])"

# --- Communication ---
COLLECTIVE_MEAN = (
    f"sum by (rank, op) (rate({m.COLLECTIVE_DURATION.sample('sum')}{{D}}[$__rate_interval]))"
    f" / sum by (rank, op) (rate({m.COLLECTIVE_DURATION.sample('count')}{{D}}"
    "[$__rate_interval]))"
)
COLLECTIVE_P99 = hq(0.99, f"{m.COLLECTIVE_DURATION.name}", "rank, op", "{D}")
COLLECTIVE_RUN_P99 = f"{n.COLLECTIVE_RUN_P99}{{RR}}"
COLLECTIVE_BYTES = f"rate({m.COLLECTIVE_BYTES.name}{{D}}[$__rate_interval])"
SLOWDOWN = f"{n.STRAGGLER_SLOWDOWN}{{DR}}"
SLOWDOWN_BY_CAUSE = (
    f"{n.OWN_BY_CAUSE}{{DR}} - on (run, stage, cause) group_left () "
    f"max by (run, stage, cause) ({n.OWN_MEDIAN_BY_CAUSE}{{RR}})"
)
"""This rank's own seconds per step above its run's (pipeline stage's) median rank's, by cause
(the median recorded per run, stage and cause)."""
STEPS_BEHIND = f"max by (run) ({n.STEP_LEADER}{{RR}}) - on (run) group_right {m.STEP.name}{{D}}"

# --- GPU ---
GPU_UTIL = f"{m.GPU_UTILIZATION.name}{{D}}"
GPU_TEMP = f"{m.GPU_TEMPERATURE.name}{{D}}"
GPU_POWER = f"{m.GPU_POWER.name}{{D}}"


def dcgm(metric: str, cfg: MixinConfig) -> str:
    """A dcgm-exporter series of the rank's GPU, joined by ``gpu_uuid`` = ``UUID``; restricted
    by ``MixinConfig.dashboard_dcgm_selector`` when set."""
    matchers = f"{{{cfg.dashboard_dcgm_selector}}}" if cfg.dashboard_dcgm_selector.strip() else ""
    return (
        f"{metric}{matchers} * on (UUID) group_left (run, rank) "
        f'label_replace({m.RANK_INFO.name}{{D}}, "UUID", "$1", "gpu_uuid", "(.+)")'
    )
