"""Layout of "ddpmon / Rank detail": one rank's four layers against the run, plus its GPU.

The PromQL lives in :mod:`.queries.detail`; this module only places it.
"""

from __future__ import annotations

from typing import Any

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards import common
from ddpmon.mixin.dashboards.model import (
    ANY,
    DCGM,
    DETAIL_TITLE,
    DETAIL_UID,
    EVERY_RANK,
    FAULT,
    GPU,
    RUN,
    DashboardSpec,
    PanelSpec,
    Query,
    RowSpec,
)
from ddpmon.mixin.dashboards.promql import expand
from ddpmon.mixin.dashboards.queries import detail as Q


def _rank_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Rank",
        (
            PanelSpec(
                "Up", "stat", "bool_yes_no",
                (q(Q.UP, "scraped", instant=True),),
                "Whether Prometheus can scrape this rank now (DdpmonRankDown when not).",
                width=3, height=5, base_color="red", thresholds=((1, "green"),),
            ),
            PanelSpec(
                "Identity", "table", "none",
                (q(Q.IDENTITY, instant=True, fmt="table"),),
                "Where this rank runs; gpu_uuid joins it to dcgm-exporter series.",
                width=9, height=5, hide_columns=("Time", "Value"),
            ),
            PanelSpec(
                "Build", "table", "none",
                (q(Q.BUILD, coverage=RUN, instant=True, fmt="table"),),
                "ddpmon, torch, CUDA, NCCL and Python versions of this rank.",
                width=6, height=5, hide_columns=("Time", "Value"),
            ),
            PanelSpec(
                "Collectors", "stat", "bool_yes_no",
                (q(Q.COLLECTORS, "{{collector}}", instant=True),),
                "Whether each live reading works here (NVML and allocator are 'no' on CPU).",
                width=6, height=5, base_color="red", thresholds=((1, "green"),),
            ),
            PanelSpec(
                "Agent errors", "timeseries", "short",
                (q(Q.AGENT_ERRORS, "{{probe}}", ANY),),
                "Probe failures per rate interval, by probe (training goes on; the series the "
                "probe feeds are missing). Empty when healthy.",
                width=24, height=5,
            ),
        ),
    )


def _numerics_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Numerics",
        (
            PanelSpec(
                "Loss", "timeseries", "none",
                (q(Q.LOSS, "rank {{rank}}"), q(Q.LOSS_MEDIAN, "run median", RUN)),
                "This rank's last observed loss against the run median.",
                dashed_series=("run median",),
            ),
            PanelSpec(
                "Grad norms", "timeseries", "none",
                (
                    q(Q.GRAD_NORM, "global (after all-reduce)"),
                    q(Q.LOCAL_NORM, "local (before all-reduce)"),
                ),
                "Unscaled gradient L2 norms; the local one is this rank's own contribution.",
                log_scale=True,
            ),
            PanelSpec(
                "Grad norm by module group", "timeseries", "none",
                (q(Q.GROUP_NORM_TOP, "{{group}}"),),
                "Post-reduce norm per module group (largest k): which layer blows up. The "
                "same on every rank: under series_profile=large, rank 0's.",
                log_scale=True,
            ),
            PanelSpec(
                "Loss scale", "timeseries", "short",
                (q(Q.LOSS_SCALE, "scale"), q(Q.LOSS_SCALE_FLOOR, "floor")),
                "fp16 loss scale (GradScaler or DeepSpeed's) and its configured floor.",
                log_scale=True, dashed_series=("floor",),
            ),
            PanelSpec(
                "Non-finite and skipped steps", "timeseries", "short",
                (
                    q(Q.NONFINITE_REDUCED, "non-finite reduced grads"),
                    q(Q.NONFINITE_ORIGIN, "non-finite local grads (origin)"),
                    q(Q.NONFINITE_LOSS, "non-finite losses"),
                    q(Q.SKIPPED, "skipped by the {{by}}"),
                ),
                "Counts per rate interval.",
            ),
            PanelSpec(
                "First non-finite gradient", "table", "none",
                (q(Q.FIRST_NONFINITE, coverage=FAULT, instant=True, fmt="table"),),
                "The first step and parameter where this rank's own gradients went NaN/Inf.",
                hide_columns=("Time", "Value"),
            ),
        ),
    )


def _data_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Data supply",
        (
            PanelSpec(
                "Step time", "timeseries", "s",
                (
                    q(Q.STEP_P50, "p50"),
                    q(Q.STEP_P99, "p99"),
                    q(Q.STEP_P99_MEDIAN, "median rank p99", RUN),
                ),
                "Step wall time (data wait excluded) against the median rank.",
                width=8, dashed_series=("median rank p99",),
            ),
            PanelSpec(
                "Data wait", "timeseries", "s",
                (
                    q(Q.DATA_WAIT_P50, "p50"),
                    q(Q.DATA_WAIT_P99, "p99"),
                    q(Q.DATA_WAIT_MEDIAN, "median rank mean", RUN),
                ),
                "Time waiting for the next batch, against the median rank's mean.",
                width=8, dashed_series=("median rank mean",),
            ),
            PanelSpec(
                "Steps/s", "timeseries", "suffix: steps/s",
                (q(Q.STEPS_RATE, "rank {{rank}}"), q(Q.STEPS_RATE_MEDIAN, "run median", RUN)),
                "Throughput against the run median.",
                width=8, dashed_series=("run median",),
            ),
        ),
    )


def _memory_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Memory",
        (
            PanelSpec(
                "Allocator memory", "timeseries", "bytes",
                (
                    q(Q.RESERVED, "reserved", GPU),
                    q(Q.ALLOCATED, "allocated", GPU),
                    q(Q.PEAK, "peak allocated", GPU),
                    q(Q.DEVICE_TOTAL, "device total (NVML)", GPU),
                    q(Q.DEVICE_USED, "device used (NVML)", GPU),
                ),
                "torch allocator against the whole device as NVML sees it.",
                dashed_series=("device total (NVML)",),
            ),
            PanelSpec(
                "Allocator retries and OOMs", "timeseries", "short",
                (q(Q.ALLOC_RETRIES, "retries", GPU), q(Q.OOMS, "OOMs", GPU)),
                "cudaMalloc retries (cache flushes under pressure) and OOMs per interval.",
            ),
            PanelSpec(
                "Host process", "timeseries", "bytes",
                (q(Q.RSS, "resident"), q(Q.RSS_MEDIAN, "run median", RUN)),
                "Resident memory of this training process.",
                dashed_series=("run median",),
            ),
            PanelSpec(
                "Host CPU", "timeseries", "percentunit",
                (q(Q.CPU, "cores busy"),),
                "CPU time of this training process per second (1 = one core).",
            ),
        ),
    )


def _comm_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Communication",
        (
            PanelSpec(
                "Collective latency", "timeseries", "s",
                (
                    q(Q.COLLECTIVE_MEAN, "mean {{op}}"),
                    q(Q.COLLECTIVE_P99, "p99 {{op}}"),
                    q(Q.COLLECTIVE_RUN_P99, "run p99 {{op}}", RUN),
                ),
                "Time of one collective per op on this rank (exact mean; p99 from coarse "
                "buckets) against the run's p99.",
                dashed_series=("run p99",),
            ),
            PanelSpec(
                "Collective bytes", "timeseries", "Bps",
                (q(Q.COLLECTIVE_BYTES, "{{op}}"),),
                "Bytes passed to collectives per second, per op.",
            ),
            PanelSpec(
                "Slowdown vs the run's median rank", "timeseries", "percentunit",
                (q(Q.SLOWDOWN, "rank {{rank}}"),),
                "This rank's own time per step (step time and data wait, less its wait inside "
                "collectives) over the run's median rank's, less one; above the red line "
                "DdpmonStraggler fires.",
                thresholds=((cfg.straggler_slowdown, "red"),),
            ),
            PanelSpec(
                "Own time above the median rank, by cause", "timeseries", "s",
                (q(Q.SLOWDOWN_BY_CAUSE, "{{cause}}"),),
                "Seconds per step this rank spends above the run's median rank (its pipeline "
                "stage's) in data wait, compute (forward, backward, optimizer), host time and "
                "issuing its collectives: the largest is the straggler's cause.",
            ),
            PanelSpec(
                "Steps behind the leader", "timeseries", "short",
                (q(Q.STEPS_BEHIND, "rank {{rank}}"),),
                "How far this rank lags the most advanced rank.",
                thresholds=((cfg.rank_desync_steps, "red"),),
            ),
        ),
    )


def _gpu_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "GPU",
        (
            PanelSpec(
                "GPU utilisation (NVML)", "timeseries", "percentunit",
                (q(Q.GPU_UTIL, "gpu {{gpu}}", GPU),),
                "Fraction of time a kernel ran, as read by the agent.",
                width=8,
            ),
            PanelSpec(
                "GPU temperature (NVML)", "timeseries", "celsius",
                (q(Q.GPU_TEMP, "gpu {{gpu}}", GPU),),
                "Temperature of this rank's GPU; throttling starts in the 80s.",
                width=8,
            ),
            PanelSpec(
                "GPU power (NVML)", "timeseries", "watt",
                (q(Q.GPU_POWER, "gpu {{gpu}}", GPU),),
                "Power draw of this rank's GPU; a rank far below its peers is idle or "
                "throttled.",
                width=8,
            ),
            PanelSpec(
                "DCGM: this rank's GPU", "timeseries", "percent",
                (
                    q(Q.dcgm("DCGM_FI_DEV_GPU_UTIL", cfg), "utilisation %", DCGM),
                    q(Q.dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", cfg), "memory copy %", DCGM),
                ),
                "dcgm-exporter series of the GPU this rank uses, joined by gpu_uuid = UUID.",
                width=12,
            ),
            PanelSpec(
                "DCGM: last XID error", "stat", "none",
                (q(Q.dcgm("DCGM_FI_DEV_XID_ERRORS", cfg), "last XID", DCGM),),
                "The last XID error code the driver reported for this GPU (0: none); see "
                "NVIDIA's XID catalogue.",
                width=12, thresholds=((1, "red"),),
            ),
        ),
    )


def spec(cfg: MixinConfig) -> DashboardSpec:
    def q(expr: str, legend: str = "", coverage: str = EVERY_RANK, **kw: Any) -> Query:
        return Query(expand(expr, cfg), legend, coverage, **kw)

    builders = (_rank_row, _numerics_row, _data_row, _memory_row, _comm_row, _gpu_row)
    return DashboardSpec(
        DETAIL_UID,
        DETAIL_TITLE,
        "One rank of a ddpmon-monitored run: its four layers against the run median, plus its "
        "GPU (NVML, and dcgm-exporter joined by gpu_uuid).",
        tuple(build(q, cfg) for build in builders),
        rank_multi=False,
        annotations=common.annotations(cfg),
    )
