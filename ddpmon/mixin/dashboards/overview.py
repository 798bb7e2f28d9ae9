"""Layout of "ddpmon / Run overview": rows by layer, panels, units, thresholds, descriptions.

The PromQL lives in :mod:`.queries.overview`; this module only places it.
"""

from __future__ import annotations

from typing import Any

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards import common, goodput
from ddpmon.mixin.dashboards.model import (
    ANY,
    DUP_DATA,
    EVERY_RANK,
    FAULT,
    GPU,
    OVERVIEW_TITLE,
    OVERVIEW_UID,
    QUIET,
    RUN,
    DashboardSpec,
    PanelSpec,
    Query,
    RowSpec,
)
from ddpmon.mixin.dashboards.promql import expand
from ddpmon.mixin.dashboards.queries import overview as Q

DIST = (
    "Every rank of the run, whatever the rank selection: counted per run by the ruler "
    "(run:...:ranks_bucket), so the panel reads one series per bucket at any rank count."
)


def _run_row(q: Any, cfg: MixinConfig) -> RowSpec:
    health = Q.rank_health(cfg)
    coverage = {"A": EVERY_RANK, "B": EVERY_RANK, "C": EVERY_RANK, "D": EVERY_RANK,
                "E": EVERY_RANK, "F": EVERY_RANK, "G": GPU, "H": ANY}
    return RowSpec(
        "Run",
        (
            PanelSpec(
                "Ranks reporting", "stat", "percentunit",
                (q(Q.REPORTING_RATIO, "of world size", RUN),),
                "Ranks whose endpoint Prometheus scrapes, as a share of the world size they "
                "report: red below 100%.",
                width=4, height=5, base_color="red", thresholds=((1, "green"),),
            ),
            PanelSpec(
                "Heartbeat age (oldest rank)", "stat", "s",
                (q(Q.HEARTBEAT_AGE, "age", RUN),),
                "Seconds since the least recent completed step on any rank; a hang grows it.",
                width=4, height=5, thresholds=((cfg.stall_seconds, "red"),),
            ),
            PanelSpec(
                "Latest step", "stat", "short",
                (q(Q.STEP_LEADER, "leader", RUN), q(Q.STEP_SLOWEST, "slowest", RUN)),
                "Step index of the most and least advanced rank.",
                width=4, height=5,
            ),
            PanelSpec(
                "Firing ddpmon alerts", "stat", "short",
                (q(Q.FIRING_ALERTS, "firing", RUN),),
                "Alerts of this run that fire now (see the annotations on every panel).",
                width=4, height=5, thresholds=((1, "red"),),
            ),
            PanelSpec(
                "Agent probe errors", "stat", "short",
                (q(Q.AGENT_ERRORS, "errors", RUN, instant=True),),
                "Probe failures of the ddpmon agents in the time range (training goes on; the "
                "series they feed are missing). DdpmonAgentUnhealthy fires when they keep "
                "rising.",
                width=4, height=5, thresholds=((1, "orange"),),
            ),
            PanelSpec(
                "Versions", "table", "none",
                (q(Q.VERSIONS, coverage=RUN, instant=True, fmt="table"),),
                "Distinct ddpmon/torch/CUDA/NCCL/Python versions across the ranks, with the "
                "number of ranks on each: more than one row is a mixed installation.",
                width=4, height=5, hide_columns=("Time",),
            ),
            PanelSpec(
                "Rank health, worst first", "table", "none",
                tuple(
                    q(expr, coverage=coverage[ref], instant=True, fmt="table")
                    for ref, expr in health.items()
                ),
                "One row per rank, the ranks with most problems first: down, stalled (heartbeat "
                "past the stall threshold), behind the leader, straggling (own time per step "
                "above the median rank's), starved of data, short of memory. Click a rank for "
                "its detail dashboard.",
                width=18, height=10, rank_links=True,
                columns=(
                    ("A", "problems"), ("B", "up"), ("C", "heartbeat age s"),
                    ("D", "steps behind"), ("E", "slowdown"), ("F", "data wait share"),
                    ("G", "memory headroom"), ("H", "firing alerts"),
                ),
                sort_by="problems",
            ),
            PanelSpec(
                "Down or missing ranks", "table", "none",
                (
                    q(Q.DOWN_RANKS, coverage=QUIET, instant=True, fmt="table"),
                    q(Q.MISSING_RANKS, coverage=QUIET, instant=True, fmt="table"),
                ),
                "Ranks Prometheus cannot scrape (up = 0: the process died or hangs hard) and "
                "ranks seen in the time range that stopped reporting. Empty when healthy.",
                width=6, height=10, rank_links=True, hide_columns=("Time", "Value"),
            ),
        ),
    )


def _numerics_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Numerics",
        (
            PanelSpec(
                "Loss", "timeseries", "none",
                (q(Q.LOSS_MEDIAN, "run median", RUN), q(Q.LOSS_TOP, "rank {{rank}}")),
                "Last observed loss: the run median and the k ranks with the highest loss.",
                dashed_series=("run median",), rank_links=True,
            ),
            PanelSpec(
                "Global grad norm", "timeseries", "none",
                (q(Q.GRAD_NORM_RUN, "largest finite", RUN),),
                "L2 norm of the unscaled gradients after the all-reduce (identical on every "
                "rank of a healthy DDP run): the largest finite value across ranks.",
                log_scale=True,
            ),
            PanelSpec(
                "Grad-norm spread across ranks", "timeseries", "percentunit",
                (q(Q.GRAD_NORM_SPREAD, "spread at the same step", ANY),),
                "(max - min) / max of the post-all-reduce norms of ranks at the same step; "
                "DdpmonGradDesync fires above the red line. Empty when no two ranks were "
                "scraped at the same step.",
                thresholds=((cfg.grad_desync_relative, "red"),),
            ),
            PanelSpec(
                "Local pre-all-reduce grad norm per rank", "timeseries", "none",
                (
                    q(Q.LOCAL_NORM_MEDIAN, "run median", RUN),
                    q(Q.LOCAL_NORM_TOP, "top {{rank}}"),
                ),
                "This rank's own gradient norm before averaging: the rank whose data or "
                "numerics go wrong stands out here before the all-reduce spreads it.",
                log_scale=True, dashed_series=("run median",), rank_links=True,
            ),
            PanelSpec(
                "Non-finite steps", "timeseries", "short",
                (
                    q(Q.NONFINITE_REDUCED, "reduced grads", RUN),
                    q(Q.NONFINITE_ORIGIN, "origin rank-steps", RUN),
                    q(Q.NONFINITE_LOSS, "non-finite losses", RUN),
                ),
                "Steps whose reduced gradients held NaN/Inf, rank-steps where a rank's own "
                "gradients did (the origin), and non-finite losses.",
            ),
            PanelSpec(
                "Non-finite origin ranks", "table", "none",
                (q(Q.ORIGIN_TABLE, coverage=FAULT, instant=True, fmt="table"),),
                "Ranks whose local gradients went non-finite first, with the step and the "
                "parameter where each saw it.",
                rank_links=True, hide_columns=("Time", "Value"),
            ),
            PanelSpec(
                "Loss scale per rank", "timeseries", "short",
                (
                    q(Q.LOSS_SCALE_LOWEST, "lowest {{rank}}"),
                    q(Q.LOSS_SCALE_FLOOR, "floor", RUN),
                ),
                "fp16 loss scale (GradScaler or DeepSpeed's) of the k ranks with the lowest "
                "scale; the dashed red "
                "line is the configured floor, at which DdpmonLossScaleAtFloor fires.",
                log_scale=True, dashed_series=("floor",), rank_links=True,
            ),
            PanelSpec(
                "Skipped steps", "timeseries", "percentunit",
                (q(Q.SKIPPED_TOP, "rank {{rank}}"),),
                "Fraction of steps the loss scaler skipped (inf/NaN found and absorbed: "
                "visible, never paged; DdpmonLossScaleCollapsing warns above the red line).",
                thresholds=((cfg.loss_scale_collapse_ratio, "red"),), rank_links=True,
            ),
        ),
    )


def _data_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Data supply",
        (
            PanelSpec(
                "Data wait per rank", "timeseries", "s",
                (q(Q.DATA_WAIT_MEDIAN, "run median", RUN), q(Q.DATA_WAIT_TOP, "mean {{rank}}")),
                "Mean time from one step's end to the next one's start (the input pipeline): "
                "the run median and the k ranks that wait longest.",
                dashed_series=("run median",), rank_links=True,
            ),
            PanelSpec(
                "Data wait across ranks", "heatmap", "s",
                (q(Q.DATA_WAIT_HEATMAP, "{{le}}", RUN, fmt="heatmap"),),
                "Distribution of the ranks' mean data wait: y = wait bucket, colour = number of "
                f"ranks; a starved rank is a lone cell far above the rest. {DIST}",
            ),
            PanelSpec(
                "Steps/s per rank", "timeseries", "suffix: steps/s",
                (
                    q(Q.STEPS_RATE_MEDIAN, "run median", RUN),
                    q(Q.STEPS_RATE_SLOWEST, "slowest {{rank}}"),
                ),
                "Throughput: the run median and the k slowest ranks.",
                dashed_series=("run median",), rank_links=True,
            ),
            PanelSpec(
                "Step time p99 across ranks", "heatmap", "s",
                (q(Q.STEP_P99_HEATMAP, "{{le}}", RUN, fmt="heatmap"),),
                "Distribution of the ranks' p99 step wall time (data wait excluded): y = "
                f"latency bucket, colour = number of ranks. {DIST}",
            ),
            PanelSpec(
                "Ranks with identical batches", "stat", "short",
                (q(Q.IDENTICAL_RANKS, "ranks", DUP_DATA, instant=True),),
                "Ranks of the run whose local gradients matched another rank's bit for bit at "
                "a sampled step in the time range: duplicated data shards "
                "(DdpmonDuplicateDataShards); 0 is the healthy case.",
                width=6, thresholds=((1, "orange"),),
            ),
            PanelSpec(
                "Identical batches across ranks", "timeseries", "short",
                (q(Q.IDENTICAL_TOP, "rank {{rank}}", DUP_DATA),),
                "Sampled steps (every data_check_interval steps, agent default 10) where "
                "another rank's local gradients were bit-identical to this rank's: the same "
                "batch was fed to both. Only ranks affected in the time range are drawn (the k "
                "with most); an empty panel is the healthy case.",
                width=18, rank_links=True,
            ),
        ),
    )


def _memory_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Memory",
        (
            PanelSpec(
                "Allocator memory per rank", "timeseries", "bytes",
                (
                    q(Q.RESERVED_TOP, "reserved {{rank}}", GPU),
                    q(Q.ALLOCATED_TOP, "allocated {{rank}}", GPU),
                    q(Q.PEAK_TOP, "peak {{rank}}", GPU),
                ),
                "torch caching allocator: reserved, allocated and peak allocated bytes of the "
                "k ranks using most.",
                rank_links=True,
            ),
            PanelSpec(
                "Device memory (NVML)", "timeseries", "bytes",
                (q(Q.DEVICE_TOTAL, "total", GPU), q(Q.DEVICE_USED_TOP, "used {{rank}}", GPU)),
                "Whole-device memory in use (other processes included) against its size.",
                dashed_series=("total",), rank_links=True,
            ),
            PanelSpec(
                "Headroom to OOM", "timeseries", "percentunit",
                (q(Q.HEADROOM_TIGHTEST, "rank {{rank}}", GPU),),
                "Share of the device not held by tensors (1 - allocator allocated / NVML "
                "total) on the k tightest ranks; DdpmonGpuMemoryNearlyFull fires below the red "
                "line. NVML used and allocator reserved include the cache and read near 100% "
                "on a well-tuned job.",
                base_color="red", thresholds=((1 - cfg.gpu_memory_full_ratio, "green"),),
                rank_links=True,
            ),
            PanelSpec(
                "OOMs and allocator retries", "timeseries", "short",
                (q(Q.OOMS, "OOMs", GPU), q(Q.RETRIES, "retries", GPU)),
                "Per rate interval, all selected ranks: an OOM is critical (DdpmonCudaOOM), "
                "sustained retries a warning (DdpmonCudaAllocRetries).",
            ),
            PanelSpec(
                "Host memory per rank", "timeseries", "bytes",
                (q(Q.RSS_MEDIAN, "run median", RUN), q(Q.RSS_TOP, "rss {{rank}}")),
                "Resident memory of each training process (host RAM, dataloader leaks).",
                dashed_series=("run median",), rank_links=True,
            ),
        ),
    )


def _comm_row(q: Any, cfg: MixinConfig) -> RowSpec:
    return RowSpec(
        "Communication",
        (
            PanelSpec(
                "Collective mean across ranks", "heatmap", "s",
                (q(Q.COLLECTIVE_MEAN_HEATMAP, "{{le}}", RUN, fmt="heatmap"),),
                "Distribution of the ranks' mean time per collective, one entry per rank and "
                "op (all_reduce, reduce_scatter, all_gather, reduce, broadcast, send, recv): y = "
                "latency bucket, colour = number of entries; each op the run issues is its own "
                f"band. {DIST}",
            ),
            PanelSpec(
                "Collective p99 across ranks", "heatmap", "s",
                (q(Q.COLLECTIVE_P99_HEATMAP, "{{le}}", RUN, fmt="heatmap"),),
                "Distribution of the ranks' p99 per op, from coarse (factor-8) buckets: a few "
                "slow ranks are a separate band, a fabric-wide problem moves the whole "
                f"distribution up. {DIST}",
            ),
            PanelSpec(
                "Collective mean by node", "timeseries", "s",
                (q(Q.COLLECTIVE_MEAN_BY_NODE, "{{node}} {{op}}", RUN),),
                "Worst rank's mean time per op on each node, the k slowest nodes: one node "
                "high is its NIC or links; all high is the fabric.",
                width=24,
            ),
            PanelSpec(
                "Collective latency per op", "timeseries", "s",
                (
                    q(Q.COLLECTIVE_MEAN_MEDIAN, "median rank mean {{op}}", RUN),
                    q(Q.COLLECTIVE_P99_MEDIAN, "median rank p99 {{op}}", RUN),
                    q(Q.COLLECTIVE_RUN_P99, "run p99 {{op}}", RUN),
                    q(Q.COLLECTIVE_MEAN_TOP, "mean {{rank}} {{op}}"),
                ),
                "Time of one collective, issue to completion, per op (DDP: one per gradient "
                "bucket; FSDP2: one reduce-scatter and all-gathers per unit; PP: each send and "
                "receive): the median rank's mean and p99, the run p99, and the mean of the k "
                "slowest ranks (picked by their mean over the time range).",
                width=24, dashed_series=("median rank mean", "median rank p99", "run p99"),
                rank_links=True,
            ),
            PanelSpec(
                "Collective bytes", "timeseries", "Bps",
                (
                    q(Q.COLLECTIVE_BYTES, "{{op}}", RUN),
                    q(Q.COLLECTIVE_BYTES_TOP, "rank {{rank}} {{op}}"),
                ),
                "Bytes passed to collectives per second, per op.",
                rank_links=True,
            ),
            PanelSpec(
                "Straggler slowdown vs the run's median rank", "timeseries", "percentunit",
                (q(Q.SLOWDOWN_TOP, "rank {{rank}}"),),
                "The k slowest ranks: own time per step (step time and data wait, less the wait "
                "inside collectives; DDP keeps step times in lockstep, so step time cannot show "
                "a straggler) over the run's median rank's, less one. Above the red line "
                "DdpmonStraggler fires.",
                thresholds=((cfg.straggler_slowdown, "red"),), rank_links=True,
            ),
            PanelSpec(
                "Stragglers, slowest first", "table", "none",
                (q(Q.STRAGGLER_TABLE, coverage=EVERY_RANK, instant=True, fmt="table"),),
                "The ten slowest ranks now, with the cause: the part of their own time (data, "
                "compute, host) furthest above the run's median rank's.",
                width=12, rank_links=True, hide_columns=("Time",),
            ),
            PanelSpec(
                "Step drift between ranks", "timeseries", "short",
                (q(Q.STEP_DRIFT, "leader - slowest", RUN), q(Q.STEP_BEHIND_TOP, "behind {{rank}}")),
                "Steps each rank lags behind the leading rank; DdpmonRankDesync fires above "
                "the red line.",
                thresholds=((cfg.rank_desync_steps, "red"),), width=12, rank_links=True,
            ),
        ),
    )


def spec(cfg: MixinConfig) -> DashboardSpec:
    def q(expr: str, legend: str = "", coverage: str = EVERY_RANK, **kw: Any) -> Query:
        return Query(expand(expr, cfg), legend, coverage, **kw)

    rows = tuple(
        build(q, cfg)
        for build in (_run_row, goodput.row, _numerics_row, _data_row, _memory_row, _comm_row)
    )
    return DashboardSpec(
        OVERVIEW_UID,
        OVERVIEW_TITLE,
        "Every rank of a ddpmon-monitored run on one time axis, by layer: numerics, data "
        "supply, memory, communication; worst first: the rank-health table lists the ranks "
        f"with most problems on top. Per-rank panels show the {cfg.dashboard_topk} worst "
        "ranks; distributions, per-node views and run quantiles cover the rest.",
        rows,
        rank_multi=True,
        annotations=common.annotations(cfg),
    )
