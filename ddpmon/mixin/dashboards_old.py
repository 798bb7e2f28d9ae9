"""Grafana dashboards as code: "ddpmon / Run overview" and "ddpmon / Rank detail".

Panels are declared as plain :class:`PanelSpec` data (title, unit, PromQL, and which ranks a
query is expected to cover), then rendered with ``grafana-foundation-sdk``. Keeping the specs
separate from the SDK lets the live test and the 1024-rank benchmark know, per query, whether it
must return a series for every rank, for the run, only after a fault, or only on a GPU node.

Selectors and thresholds come from :class:`ddpmon.mixin.config.MixinConfig`, shared with the
alert and recording rules. Regenerate with ``ddpmon dashboards --write``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ddpmon.mixin.config import MixinConfig

OVERVIEW_UID = "ddpmon-run-overview"
DETAIL_UID = "ddpmon-rank-detail"
OVERVIEW_TITLE = "ddpmon / Run overview"
DETAIL_TITLE = "ddpmon / Rank detail"
FILENAMES = {OVERVIEW_UID: "ddpmon-run-overview.json", DETAIL_UID: "ddpmon-rank-detail.json"}

# What a query is expected to return in a live run (used by the live test and the benchmark).
EVERY_RANK = "every-rank"
"""One series per rank of the run, for every rank the ``rank`` variable selects."""
RUN = "run"
"""Run-level aggregate: at least one series."""
FAULT = "fault"
"""Only has data after a fault (non-finite gradients, skipped steps); the live test injects one."""
DUP_DATA = "dup-data"
"""Only has data while ranks are fed identical batches (``ddpmon_data_identical_batches_total``
grows on every rank of a duplicated pair); the live test injects ``dup-data`` on rank 1, so
ranks 0 and 1 both count."""
GPU = "gpu"
"""Needs CUDA (torch allocator) or NVML; a CPU run exposes ``ddpmon_collector_success 0``."""
DCGM = "dcgm"
"""Needs dcgm-exporter scraped by the same Prometheus (joined on ``gpu_uuid``)."""
COVERAGES = (EVERY_RANK, RUN, FAULT, DUP_DATA, GPU, DCGM)

EXEMPT_REASONS = {
    GPU: "needs a CUDA device: torch allocator statistics and NVML readings do not exist on CPU",
    DCGM: "needs dcgm-exporter on a GPU node; joined to ranks by gpu_uuid",
}

ALERT_SELECTOR = 'alertname=~"Ddpmon.*", alertstate="firing", run=~"$run|"'


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str = ""
    coverage: str = EVERY_RANK
    instant: bool = False
    fmt: str = "time_series"  # time_series | table | heatmap

    def __post_init__(self) -> None:
        if self.coverage not in COVERAGES:
            raise ValueError(f"coverage={self.coverage!r}: expected one of {COVERAGES}")


@dataclass(frozen=True, slots=True)
class PanelSpec:
    title: str
    kind: str  # timeseries | heatmap | table | stat
    unit: str
    queries: tuple[Query, ...]
    description: str
    width: int = 12
    height: int = 8
    log_scale: bool = False
    thresholds: tuple[tuple[float, str], ...] = ()
    """Extra threshold steps ``(value, color)``; drawn as dashed lines on time series."""
    dashed_series: tuple[str, ...] = ()
    """Legend names drawn as red dashed reference lines (run median, floor)."""
    rank_links: bool = False
    """Series link to the rank-detail dashboard of the rank under the cursor."""
    hide_columns: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: tuple[RowSpec, ...]
    rank_multi: bool
    annotations: tuple[tuple[str, str, str, str], ...] = field(default=())
    """``(name, color, expr, title format)``."""


class PanelQuery(NamedTuple):
    """One query of one panel with the dashboard variables resolved."""

    title: str
    expr: str
    ref_id: str
    instant: bool
    coverage: str


# ---------------------------------------------------------------------------------------------
# PromQL building blocks


def _selectors(cfg: MixinConfig) -> dict[str, str]:
    job = cfg.job_selector
    return {
        # the ranks the user selected
        "S": f'{{{job}, run="$run", rank=~"$rank"}}',
        # every rank of the run: medians and leaders are run-wide whatever ranks are shown
        "R": f'{{{job}, run="$run"}}',
        # one rank (rank detail)
        "D": f'{{{job}, run="$run", rank="$rank"}}',
        # the same three for recording-rule outputs, which keep only run and rank
        "SR": '{run="$run", rank=~"$rank"}',
        "RR": '{run="$run"}',
        "DR": '{run="$run", rank="$rank"}',
    }


def _q(template: str, sel: Mapping[str, str], k: int) -> str:
    for key in ("SR", "RR", "DR", "S", "R", "D"):
        template = template.replace(f"{{{key}}}", sel[key])
    return template.replace("{K}", str(k))


def _hq(q: float, metric: str, by: str, s: str) -> str:
    """histogram_quantile over ``rate`` of the buckets, aggregated ``by`` (plus ``le``)."""
    return (
        f"histogram_quantile({q}, sum by ({by}, le) "
        f"(rate({metric}_bucket{s}[$__rate_interval])))"
    )


def _mean(metric: str, s: str) -> str:
    return (
        f"rate({metric}_sum{s}[$__rate_interval]) / rate({metric}_count{s}[$__rate_interval])"
    )


def _over_range(expr: str) -> str:
    """The same expression over the whole dashboard range, evaluated once at its end."""
    return expr.replace("[$__rate_interval]", "[$__range] @ end()")


def _ranked(fn: str, now: str, whole_range: str) -> str:
    """``now`` for the k ranks that rank highest (``topk``) or lowest (``bottomk``) by
    ``whole_range``: one fixed set of k ranks for the whole graph. A plain ``topk`` in a range
    query picks k ranks per step, so at 1024 ranks the graph would draw hundreds of them."""
    return f"{now} and on (rank) {fn}({{K}}, {whole_range})"


def _gauge_top(fn: str, metric: str, sel: str = "{S}") -> str:
    over = "max_over_time" if fn == "topk" else "min_over_time"
    return _ranked(fn, f"{metric}{sel}", f"{over}({metric}{sel}[$__range] @ end())")


def _rate_top(fn: str, now: str) -> str:
    return _ranked(fn, now, _over_range(now))


# ---------------------------------------------------------------------------------------------
# Run overview


def _overview(cfg: MixinConfig) -> DashboardSpec:
    sel = _selectors(cfg)
    k = cfg.dashboard_topk

    def q(expr: str, legend: str = "", coverage: str = EVERY_RANK, **kw: Any) -> Query:
        return Query(_q(expr, sel, k), legend, coverage, **kw)

    status = RowSpec(
        "Run",
        (
            PanelSpec(
                "Ranks reporting",
                "stat",
                "short",
                (
                    q("count by (run) (ddpmon_rank_info{R})", "reporting", RUN),
                    q("max by (run) (ddpmon_world_size{R})", "world size", RUN),
                ),
                "Ranks whose endpoint Prometheus scrapes, against the world size they report.",
                width=6,
                height=5,
            ),
            PanelSpec(
                "Latest step",
                "stat",
                "short",
                (
                    q("max by (run) (ddpmon_step{R})", "leader", RUN),
                    q("min by (run) (ddpmon_step{R})", "slowest", RUN),
                ),
                "Step index of the most and least advanced rank.",
                width=6,
                height=5,
            ),
            PanelSpec(
                "Heartbeat age (oldest rank)",
                "stat",
                "s",
                (
                    q(
                        "time() - min by (run) (ddpmon_last_step_timestamp_seconds{R})",
                        "age",
                        RUN,
                    ),
                ),
                "Seconds since the least recent completed step on any rank; a hang grows it.",
                width=6,
                height=5,
                thresholds=((cfg.stall_seconds, "red"),),
            ),
            PanelSpec(
                "Firing ddpmon alerts",
                "stat",
                "short",
                (q(f'count(ALERTS{{{ALERT_SELECTOR}}}) or vector(0)', "firing", RUN),),
                "Alerts of this run that fire now (see the annotations on every panel).",
                width=6,
                height=5,
                thresholds=((1, "red"),),
            ),
            PanelSpec(
                "Ranks",
                "table",
                "none",
                (
                    q(
                        "max by (rank, local_rank, node, device, gpu_uuid, backend, pid) "
                        "(ddpmon_rank_info{S})",
                        coverage=EVERY_RANK,
                        instant=True,
                        fmt="table",
                    ),
                ),
                "One row per rank; click a rank for its detail dashboard.",
                width=24,
                height=6,
                rank_links=True,
                hide_columns=("Time", "Value"),
            ),
        ),
    )
    numerics = RowSpec(
        "Numerics",
        (
            PanelSpec(
                "Loss",
                "timeseries",
                "none",
                (
                    q("quantile by (run) (0.5, ddpmon_loss{R})", "run median", RUN),
                    q(_gauge_top("topk", "ddpmon_loss"), "rank {{rank}}"),
                ),
                "Last observed loss: the run median and the k ranks with the highest loss.",
                dashed_series=("run median",),
                rank_links=True,
            ),
            PanelSpec(
                "Global grad norm per rank",
                "timeseries",
                "none",
                (
                    q(_gauge_top("topk", "ddpmon_grad_norm"), "top {{rank}}"),
                    q(_gauge_top("bottomk", "ddpmon_grad_norm"), "bottom {{rank}}"),
                ),
                "L2 norm of the unscaled gradients after the all-reduce. All ranks of a "
                "healthy DDP run agree: a gap between top and bottom is a replica desync.",
                log_scale=True,
                rank_links=True,
            ),
            PanelSpec(
                "Local pre-all-reduce grad norm per rank",
                "timeseries",
                "none",
                (
                    q(
                        "quantile by (run) (0.5, ddpmon_grad_local_norm{R})",
                        "run median",
                        RUN,
                    ),
                    q(_gauge_top("topk", "ddpmon_grad_local_norm"), "top {{rank}}"),
                    q(_gauge_top("bottomk", "ddpmon_grad_local_norm"), "bottom {{rank}}"),
                ),
                "This rank's own gradient norm before averaging: the rank whose data or "
                "numerics go wrong stands out here before the all-reduce spreads it.",
                log_scale=True,
                dashed_series=("run median",),
                rank_links=True,
            ),
            PanelSpec(
                "Non-finite steps",
                "timeseries",
                "short",
                (
                    q(
                        "max by (run) (increase(ddpmon_grad_nonfinite_steps_total{S}"
                        "[$__rate_interval]))",
                        "reduced grads",
                        RUN,
                    ),
                    q(
                        "sum by (run) (increase(ddpmon_grad_nonfinite_origin_steps_total{S}"
                        "[$__rate_interval]))",
                        "origin rank-steps",
                        RUN,
                    ),
                    q(
                        "sum by (run) (increase(ddpmon_loss_nonfinite_total{S}"
                        "[$__rate_interval]))",
                        "non-finite losses",
                        RUN,
                    ),
                ),
                "Steps whose reduced gradients held NaN/Inf, rank-steps where a rank's own "
                "gradients did (the origin), and non-finite losses.",
            ),
            PanelSpec(
                "Non-finite origin ranks",
                "table",
                "none",
                (
                    q(
                        "max by (rank, step, param, kind) "
                        "(last_over_time(ddpmon_grad_first_nonfinite_info{S}[$__range]))",
                        coverage=FAULT,
                        instant=True,
                        fmt="table",
                    ),
                ),
                "Ranks whose local gradients went non-finite first, with the step and the "
                "parameter where each saw it.",
                rank_links=True,
                hide_columns=("Time", "Value"),
            ),
            PanelSpec(
                "Loss scale per rank",
                "timeseries",
                "short",
                (
                    q(_gauge_top("topk", "ddpmon_amp_loss_scale"), "top {{rank}}"),
                    q(_gauge_top("bottomk", "ddpmon_amp_loss_scale"), "bottom {{rank}}"),
                    q("min by (run) (ddpmon_amp_loss_scale_floor{R})", "floor", RUN),
                ),
                "AMP GradScaler scale; the dashed red line is the configured floor, at which "
                "DdpmonLossScaleAtFloor fires.",
                log_scale=True,
                dashed_series=("floor",),
                rank_links=True,
            ),
            PanelSpec(
                "Skipped steps",
                "timeseries",
                "percentunit",
                (
                    q(
                        _rate_top(
                            "topk",
                            "rate(ddpmon_amp_skipped_steps_total{S}[$__rate_interval]) "
                            "/ rate(ddpmon_steps_total{S}[$__rate_interval])",
                        ),
                        "rank {{rank}}",
                    ),
                ),
                "Fraction of steps the GradScaler skipped (inf/NaN found).",
                thresholds=((cfg.loss_scale_collapse_ratio, "red"),),
                rank_links=True,
            ),
        ),
    )
    data = RowSpec(
        "Data supply",
        (
            PanelSpec(
                "Data wait per rank",
                "timeseries",
                "s",
                (
                    q(
                        "quantile by (run) (0.5, ddpmon:data_wait_seconds:mean{RR})",
                        "run median",
                        RUN,
                    ),
                    q(_gauge_top("topk", "ddpmon:data_wait_seconds:mean", "{SR}"), "mean {{rank}}"),
                ),
                "Mean time from one step's end to the next one's start (the input pipeline): "
                "the run median and the k ranks that wait longest.",
                dashed_series=("run median",),
                rank_links=True,
            ),
            PanelSpec(
                "Data wait across ranks",
                "heatmap",
                "s",
                (q("ddpmon:data_wait_seconds:mean{SR}", "{{rank}}"),),
                "One row per rank, colour = mean data wait: a starved rank is a bright row.",
            ),
            PanelSpec(
                "Steps/s per rank",
                "timeseries",
                "suffix: steps/s",
                (
                    q(
                        "quantile by (run) (0.5, rate(ddpmon_steps_total{R}[$__rate_interval]))",
                        "run median",
                        RUN,
                    ),
                    q(
                        _rate_top("bottomk", "rate(ddpmon_steps_total{S}[$__rate_interval])"),
                        "slowest {{rank}}",
                    ),
                ),
                "Throughput: the run median and the k slowest ranks.",
                dashed_series=("run median",),
                rank_links=True,
            ),
            PanelSpec(
                "Step time p99 across ranks",
                "heatmap",
                "s",
                (q("ddpmon:step_duration_seconds:p99{SR}", "{{rank}}"),),
                "One row per rank, colour = p99 step wall time (data wait excluded).",
            ),
            PanelSpec(
                "Ranks with identical batches",
                "stat",
                "short",
                (
                    q(
                        "count by (run) (changes("
                        "ddpmon_data_identical_batches_total{R}[$__range] @ end()) > 0) "
                        "or vector(0)",
                        "ranks",
                        DUP_DATA,
                        instant=True,
                    ),
                ),
                "Ranks of the run whose local gradients matched another rank's bit for bit at "
                "a sampled step in the time range: duplicated data shards "
                "(DdpmonDuplicateDataShards); 0 is the healthy case.",
                width=6,
                thresholds=((1, "orange"),),
            ),
            PanelSpec(
                "Identical batches across ranks",
                "timeseries",
                "short",
                (
                    q(
                        _ranked(
                            "topk",
                            "increase(ddpmon_data_identical_batches_total{S}[$__rate_interval])",
                            "increase(ddpmon_data_identical_batches_total{S}[$__range] @ end())"
                            " > 0",
                        ),
                        "rank {{rank}}",
                        DUP_DATA,
                    ),
                ),
                "Sampled steps (every data_check_interval steps, agent default 10) where "
                "another rank's local gradients were bit-identical to this rank's: the same "
                "batch was fed to both. Only ranks affected in the time range are drawn (the k "
                "with most); an empty panel is the healthy case.",
                width=18,
                rank_links=True,
            ),
        ),
    )
    memory = RowSpec(
        "Memory",
        (
            PanelSpec(
                "Allocator memory per rank",
                "timeseries",
                "bytes",
                (
                    q(
                        _gauge_top("topk", "ddpmon_cuda_memory_reserved_bytes"),
                        "reserved {{rank}}",
                        GPU,
                    ),
                    q(
                        _gauge_top("topk", "ddpmon_cuda_memory_allocated_bytes"),
                        "allocated {{rank}}",
                        GPU,
                    ),
                    q(
                        _gauge_top("topk", "ddpmon_cuda_memory_peak_allocated_bytes"),
                        "peak {{rank}}",
                        GPU,
                    ),
                ),
                "torch caching allocator: reserved, allocated and peak allocated bytes of the "
                "k ranks using most.",
                rank_links=True,
            ),
            PanelSpec(
                "Device memory (NVML)",
                "timeseries",
                "bytes",
                (
                    q("max by (run) (ddpmon_gpu_memory_total_bytes{S})", "total", GPU),
                    q(_gauge_top("topk", "ddpmon_gpu_memory_used_bytes"), "used {{rank}}", GPU),
                ),
                "Whole-device memory in use (other processes included) against its size.",
                dashed_series=("total",),
                rank_links=True,
            ),
            PanelSpec(
                "Headroom to OOM",
                "timeseries",
                "percentunit",
                (
                    q(
                        _ranked(
                            "topk",
                            "1 - ddpmon_gpu_memory_used_bytes{S} "
                            "/ ddpmon_gpu_memory_total_bytes{S}",
                            "max_over_time(ddpmon_gpu_memory_used_bytes{S}[$__range] @ end()) "
                            "/ ddpmon_gpu_memory_total_bytes{S} @ end()",
                        ),
                        "rank {{rank}}",
                        GPU,
                    ),
                    q(
                        "sum by (run) (increase(ddpmon_cuda_ooms_total{S}[$__rate_interval]))",
                        "OOMs",
                        GPU,
                    ),
                ),
                "Free device memory of the k tightest ranks; DdpmonGpuMemoryNearlyFull fires "
                "below the red line.",
                thresholds=((1 - cfg.gpu_memory_full_ratio, "red"),),
                rank_links=True,
            ),
            PanelSpec(
                "Host memory per rank",
                "timeseries",
                "bytes",
                (
                    q(
                        "quantile by (run) (0.5, ddpmon_process_resident_memory_bytes{R})",
                        "run median",
                        RUN,
                    ),
                    q(_gauge_top("topk", "ddpmon_process_resident_memory_bytes"), "rss {{rank}}"),
                ),
                "Resident memory of each training process (host RAM, dataloader leaks).",
                dashed_series=("run median",),
                rank_links=True,
            ),
        ),
    )
    comm = RowSpec(
        "Communication",
        (
            PanelSpec(
                "All-reduce p50 across ranks",
                "heatmap",
                "s",
                (q("ddpmon:allreduce_duration_seconds:p50{SR}", "{{rank}}"),),
                "One row per rank, colour = all-reduce median: the typical collective; a rank "
                "or node whose every all-reduce is slow is a bright row.",
            ),
            PanelSpec(
                "All-reduce p99 across ranks",
                "heatmap",
                "s",
                (q("ddpmon:allreduce_duration_seconds:p99{SR}", "{{rank}}"),),
                "One row per rank, colour = all-reduce p99: a slow link or rank is a bright "
                "row, a fabric-wide problem a bright column.",
            ),
            PanelSpec(
                "All-reduce latency per rank",
                "timeseries",
                "s",
                (
                    q(
                        "quantile by (run) (0.5, ddpmon:allreduce_duration_seconds:p50{RR})",
                        "median rank p50",
                        RUN,
                    ),
                    q(
                        "quantile by (run) (0.5, ddpmon:allreduce_duration_seconds:p99{RR})",
                        "median rank p99",
                        RUN,
                    ),
                    q("ddpmon:allreduce_duration_seconds:run_p99{RR}", "run p99", RUN),
                    q(
                        _gauge_top("topk", "ddpmon:allreduce_duration_seconds:p99", "{SR}"),
                        "p99 {{rank}}",
                    ),
                    q(
                        _gauge_top("topk", "ddpmon:allreduce_duration_seconds:p50", "{SR}"),
                        "p50 {{rank}}",
                    ),
                ),
                "Per-bucket all-reduce time, launch to completion: the run p99, the median "
                "rank's p50 and p99, and p50/p99 of the k slowest ranks (each picked by its "
                "own quantile over the time range).",
                width=24,
                dashed_series=("median rank p50", "median rank p99", "run p99"),
                rank_links=True,
            ),
            PanelSpec(
                "All-reduce bytes",
                "timeseries",
                "Bps",
                (
                    q(
                        "sum by (run) (rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval]))",
                        "selected ranks",
                        RUN,
                    ),
                    q(
                        _rate_top(
                            "topk", "rate(ddpmon_allreduce_bytes_total{S}[$__rate_interval])"
                        ),
                        "rank {{rank}}",
                    ),
                ),
                "Gradient bytes all-reduced per second.",
                rank_links=True,
            ),
            PanelSpec(
                "Step-time skew vs run median",
                "timeseries",
                "suffix:×",
                (
                    q(
                        _ranked(
                            "topk",
                            "ddpmon:step_duration_seconds:mean{SR} / on (run) group_left "
                            "quantile by (run) (0.5, ddpmon:step_duration_seconds:mean{RR})",
                            "max_over_time(ddpmon:step_duration_seconds:mean{SR}"
                            "[$__range] @ end())",
                        ),
                        "rank {{rank}}",
                    ),
                ),
                "Each rank's mean step time over the run median: stragglers sit above the red "
                "line, where DdpmonStraggler fires.",
                thresholds=((cfg.straggler_ratio, "red"),),
                rank_links=True,
            ),
            PanelSpec(
                "Step drift between ranks",
                "timeseries",
                "short",
                (
                    q(
                        "max by (run) (ddpmon_step{R}) - min by (run) (ddpmon_step{R})",
                        "leader - slowest",
                        RUN,
                    ),
                    q(
                        _ranked(
                            "bottomk",
                            "max by (run) (ddpmon_step{R}) - on (run) group_right ddpmon_step{S}",
                            "last_over_time(ddpmon_step{S}[$__range] @ end())",
                        ),
                        "behind {{rank}}",
                    ),
                ),
                "Steps each rank lags behind the leading rank; DdpmonRankDesync fires above "
                "the red line.",
                thresholds=((cfg.rank_desync_steps, "red"),),
                width=24,
                rank_links=True,
            ),
        ),
    )
    return DashboardSpec(
        OVERVIEW_UID,
        OVERVIEW_TITLE,
        "Every rank of a ddpmon-monitored run on one time axis, by layer: numerics, data "
        "supply, memory, communication. Per-rank panels show the top/bottom "
        f"{k} ranks; heatmaps and run quantiles cover the rest.",
        (status, numerics, data, memory, comm),
        rank_multi=True,
        annotations=_annotations(sel),
    )


def _annotations(sel: Mapping[str, str]) -> tuple[tuple[str, str, str, str], ...]:
    r = sel["R"]
    return (
        ("Firing ddpmon alerts", "red", f"ALERTS{{{ALERT_SELECTOR}}}", "{{alertname}}"),
        (
            "Non-finite steps",
            "orange",
            f"sum by (run, rank) (increase(ddpmon_grad_nonfinite_origin_steps_total{r}"
            "[$__rate_interval])) > 0",
            "non-finite gradients on rank {{rank}}",
        ),
        (
            "Skipped steps",
            "yellow",
            f"max by (run) (increase(ddpmon_amp_skipped_steps_total{r}[$__rate_interval])) > 0",
            "optimizer steps skipped by the GradScaler",
        ),
    )


# ---------------------------------------------------------------------------------------------
# Rank detail


def _detail(cfg: MixinConfig) -> DashboardSpec:
    sel = _selectors(cfg)
    k = cfg.dashboard_topk

    def q(expr: str, legend: str = "", coverage: str = EVERY_RANK, **kw: Any) -> Query:
        return Query(_q(expr, sel, k), legend, coverage, **kw)

    identity = RowSpec(
        "Rank",
        (
            PanelSpec(
                "Identity",
                "table",
                "none",
                (
                    q(
                        "max by (rank, local_rank, world_size, node, backend, device, gpu_uuid, "
                        "pid) (ddpmon_rank_info{D})",
                        instant=True,
                        fmt="table",
                    ),
                ),
                "Where this rank runs; gpu_uuid joins it to dcgm-exporter series.",
                width=16,
                height=5,
                hide_columns=("Time", "Value"),
            ),
            PanelSpec(
                "Collectors",
                "stat",
                "bool_yes_no",
                (q("ddpmon_collector_success{D}", "{{collector}}", instant=True),),
                "Whether each live reading works here (NVML and allocator are 'no' on CPU).",
                width=8,
                height=5,
            ),
        ),
    )
    numerics = RowSpec(
        "Numerics",
        (
            PanelSpec(
                "Loss",
                "timeseries",
                "none",
                (
                    q("ddpmon_loss{D}", "rank {{rank}}"),
                    q("quantile by (run) (0.5, ddpmon_loss{R})", "run median", RUN),
                ),
                "This rank's last observed loss against the run median.",
                dashed_series=("run median",),
            ),
            PanelSpec(
                "Grad norms",
                "timeseries",
                "none",
                (
                    q("ddpmon_grad_norm{D}", "global (after all-reduce)"),
                    q("ddpmon_grad_local_norm{D}", "local (before all-reduce)"),
                ),
                "Unscaled gradient L2 norms; the local one is this rank's own contribution.",
                log_scale=True,
            ),
            PanelSpec(
                "Grad norm by module group",
                "timeseries",
                "none",
                (
                    q(
                        "ddpmon_grad_group_norm{D} and on (group) topk({K}, "
                        "max_over_time(ddpmon_grad_group_norm{D}[$__range] @ end()))",
                        "{{group}}",
                    ),
                ),
                "Post-reduce norm per module group (largest k): which layer blows up.",
                log_scale=True,
            ),
            PanelSpec(
                "Loss scale",
                "timeseries",
                "short",
                (
                    q("ddpmon_amp_loss_scale{D}", "scale"),
                    q("ddpmon_amp_loss_scale_floor{D}", "floor"),
                ),
                "AMP GradScaler scale and its configured floor.",
                log_scale=True,
                dashed_series=("floor",),
            ),
            PanelSpec(
                "Non-finite and skipped steps",
                "timeseries",
                "short",
                (
                    q(
                        "increase(ddpmon_grad_nonfinite_steps_total{D}[$__rate_interval])",
                        "non-finite reduced grads",
                    ),
                    q(
                        "increase(ddpmon_grad_nonfinite_origin_steps_total{D}[$__rate_interval])",
                        "non-finite local grads (origin)",
                    ),
                    q(
                        "increase(ddpmon_loss_nonfinite_total{D}[$__rate_interval])",
                        "non-finite losses",
                    ),
                    q(
                        "increase(ddpmon_amp_skipped_steps_total{D}[$__rate_interval])",
                        "skipped by GradScaler",
                    ),
                ),
                "Counts per rate interval.",
            ),
            PanelSpec(
                "First non-finite gradient",
                "table",
                "none",
                (
                    q(
                        "max by (rank, step, param, kind) "
                        "(last_over_time(ddpmon_grad_first_nonfinite_info{D}[$__range]))",
                        coverage=FAULT,
                        instant=True,
                        fmt="table",
                    ),
                ),
                "The first step and parameter where this rank's own gradients went NaN/Inf.",
                hide_columns=("Time", "Value"),
            ),
        ),
    )
    data = RowSpec(
        "Data supply",
        (
            PanelSpec(
                "Step time",
                "timeseries",
                "s",
                (
                    q(_hq(0.5, "ddpmon_step_duration_seconds", "rank", "{D}"), "p50"),
                    q(_hq(0.99, "ddpmon_step_duration_seconds", "rank", "{D}"), "p99"),
                    q(
                        "quantile by (run) (0.5, ddpmon:step_duration_seconds:p99{RR})",
                        "median rank p99",
                        RUN,
                    ),
                ),
                "Step wall time (data wait excluded) against the median rank.",
                width=8,
                dashed_series=("median rank p99",),
            ),
            PanelSpec(
                "Data wait",
                "timeseries",
                "s",
                (
                    q(_hq(0.5, "ddpmon_data_wait_seconds", "rank", "{D}"), "p50"),
                    q(_hq(0.99, "ddpmon_data_wait_seconds", "rank", "{D}"), "p99"),
                    q(
                        "quantile by (run) (0.5, ddpmon:data_wait_seconds:mean{RR})",
                        "median rank mean",
                        RUN,
                    ),
                ),
                "Time waiting for the next batch, against the median rank's mean.",
                width=8,
                dashed_series=("median rank mean",),
            ),
            PanelSpec(
                "Steps/s",
                "timeseries",
                "suffix: steps/s",
                (
                    q("rate(ddpmon_steps_total{D}[$__rate_interval])", "rank {{rank}}"),
                    q(
                        "quantile by (run) (0.5, rate(ddpmon_steps_total{R}[$__rate_interval]))",
                        "run median",
                        RUN,
                    ),
                ),
                "Throughput against the run median.",
                width=8,
                dashed_series=("run median",),
            ),
        ),
    )
    memory = RowSpec(
        "Memory",
        (
            PanelSpec(
                "Allocator memory",
                "timeseries",
                "bytes",
                (
                    q("ddpmon_cuda_memory_reserved_bytes{D}", "reserved", GPU),
                    q("ddpmon_cuda_memory_allocated_bytes{D}", "allocated", GPU),
                    q("ddpmon_cuda_memory_peak_allocated_bytes{D}", "peak allocated", GPU),
                    q("ddpmon_gpu_memory_total_bytes{D}", "device total (NVML)", GPU),
                    q("ddpmon_gpu_memory_used_bytes{D}", "device used (NVML)", GPU),
                ),
                "torch allocator against the whole device as NVML sees it.",
                dashed_series=("device total (NVML)",),
            ),
            PanelSpec(
                "Allocator retries and OOMs",
                "timeseries",
                "short",
                (
                    q(
                        "increase(ddpmon_cuda_alloc_retries_total{D}[$__rate_interval])",
                        "retries",
                        GPU,
                    ),
                    q("increase(ddpmon_cuda_ooms_total{D}[$__rate_interval])", "OOMs", GPU),
                ),
                "cudaMalloc retries (cache flushes under pressure) and OOMs per interval.",
            ),
            PanelSpec(
                "Host process",
                "timeseries",
                "bytes",
                (
                    q("ddpmon_process_resident_memory_bytes{D}", "resident"),
                    q(
                        "quantile by (run) (0.5, ddpmon_process_resident_memory_bytes{R})",
                        "run median",
                        RUN,
                    ),
                ),
                "Resident memory of this training process.",
                dashed_series=("run median",),
            ),
            PanelSpec(
                "Host CPU",
                "timeseries",
                "percentunit",
                (
                    q(
                        "rate(ddpmon_process_cpu_seconds_total{D}[$__rate_interval])",
                        "cores busy",
                    ),
                ),
                "CPU time of this training process per second (1 = one core).",
            ),
        ),
    )
    comm = RowSpec(
        "Communication",
        (
            PanelSpec(
                "All-reduce latency",
                "timeseries",
                "s",
                (
                    q(_hq(0.5, "ddpmon_allreduce_duration_seconds", "rank", "{D}"), "p50"),
                    q(_hq(0.99, "ddpmon_allreduce_duration_seconds", "rank", "{D}"), "p99"),
                    q("ddpmon:allreduce_duration_seconds:run_p99{RR}", "run p99", RUN),
                ),
                "Per-bucket all-reduce time of this rank against the run.",
                dashed_series=("run p99",),
            ),
            PanelSpec(
                "All-reduce bytes",
                "timeseries",
                "Bps",
                (q("rate(ddpmon_allreduce_bytes_total{D}[$__rate_interval])", "bytes/s"),),
                "Gradient bytes all-reduced per second.",
            ),
            PanelSpec(
                "Step time vs run median",
                "timeseries",
                "suffix:×",
                (
                    q(
                        "ddpmon:step_duration_seconds:mean{DR} / on (run) group_left "
                        "quantile by (run) (0.5, ddpmon:step_duration_seconds:mean{RR})",
                        "rank {{rank}}",
                    ),
                ),
                "Above the red line this rank is a straggler.",
                thresholds=((cfg.straggler_ratio, "red"),),
            ),
            PanelSpec(
                "Steps behind the leader",
                "timeseries",
                "short",
                (
                    q(
                        "max by (run) (ddpmon_step{R}) - on (run) group_right ddpmon_step{D}",
                        "rank {{rank}}",
                    ),
                ),
                "How far this rank lags the most advanced rank.",
                thresholds=((cfg.rank_desync_steps, "red"),),
            ),
        ),
    )
    dcgm_join = (
        ' * on (UUID) group_left (run, rank) label_replace(ddpmon_rank_info{D}, "UUID", "$1", '
        '"gpu_uuid", "(.+)")'
    )
    # Optional matchers for dcgm-exporter series (MixinConfig.dashboard_dcgm_selector).
    dcgm = f"{{{cfg.dashboard_dcgm_selector}}}" if cfg.dashboard_dcgm_selector.strip() else ""
    gpu = RowSpec(
        "GPU",
        (
            PanelSpec(
                "GPU utilisation (NVML)",
                "timeseries",
                "percentunit",
                (q("ddpmon_gpu_utilization_ratio{D}", "gpu {{gpu}}", GPU),),
                "Fraction of time a kernel ran, as read by the agent.",
                width=8,
            ),
            PanelSpec(
                "GPU temperature and power (NVML)",
                "timeseries",
                "celsius",
                (
                    q("ddpmon_gpu_temperature_celsius{D}", "temperature gpu {{gpu}}", GPU),
                    q("ddpmon_gpu_power_watts{D}", "power gpu {{gpu}}", GPU),
                ),
                "Temperature (left axis) and power draw (watts, right axis).",
                width=8,
            ),
            PanelSpec(
                "DCGM: this rank's GPU",
                "timeseries",
                "percent",
                (
                    q(f"DCGM_FI_DEV_GPU_UTIL{dcgm}{dcgm_join}", "utilisation %", DCGM),
                    q(f"DCGM_FI_DEV_MEM_COPY_UTIL{dcgm}{dcgm_join}", "memory copy %", DCGM),
                    q(f"DCGM_FI_DEV_XID_ERRORS{dcgm}{dcgm_join}", "last XID", DCGM),
                ),
                "dcgm-exporter series of the GPU this rank uses, joined by gpu_uuid = UUID.",
                width=8,
            ),
        ),
    )
    return DashboardSpec(
        DETAIL_UID,
        DETAIL_TITLE,
        "One rank of a ddpmon-monitored run: its four layers against the run median, plus its "
        "GPU (NVML, and dcgm-exporter joined by gpu_uuid).",
        (identity, numerics, data, memory, comm, gpu),
        rank_multi=False,
        annotations=_annotations(sel),
    )


def specs(cfg: MixinConfig | None = None) -> tuple[DashboardSpec, DashboardSpec]:
    cfg = cfg or MixinConfig()
    return _overview(cfg), _detail(cfg)


# ---------------------------------------------------------------------------------------------
# Rendering with grafana-foundation-sdk


def _rank_link(title: str = "Rank detail: rank ${__field.labels.rank}") -> dict[str, Any]:
    return {
        "title": title,
        "url": f"/d/{DETAIL_UID}/ddpmon-rank-detail?var-datasource=${{datasource}}"
        "&var-run=${__field.labels.run}&var-rank=${__field.labels.rank}&${__url_time_range}",
    }


def _render(spec: DashboardSpec, cfg: MixinConfig) -> dict[str, Any]:
    # Lazy: the SDK is an optional extra (``ddpmon[dashboards]``).
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as pm

    ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    job = cfg.job_selector
    run_var = (
        db.QueryVariable("run")
        .label("Run")
        .datasource(ds)
        .query(f"label_values(ddpmon_rank_info{{{job}}}, run)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_DESC)
    )
    rank_var = (
        db.QueryVariable("rank")
        .label("Rank")
        .datasource(ds)
        .query(f'label_values(ddpmon_rank_info{{{job}, run="$run"}}, rank)')
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NUMERICAL_ASC)
    )
    if spec.rank_multi:
        rank_var = (
            rank_var.multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        )
    dash = (
        db.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(cfg.dashboard_tags))
        .refresh(cfg.dashboard_refresh)
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .with_variable(
            db.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(run_var)
        .with_variable(rank_var)
        .link(
            db.DashboardLink("ddpmon dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(list(cfg.dashboard_tags))
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for name, color, expr, _title in spec.annotations:
        dash = dash.annotation(
            db.AnnotationQuery().name(name).datasource(ds).enable(True).icon_color(color).expr(expr)
        )

    panel_id = 0
    for row in spec.rows:
        panel_id += 1
        dash = dash.with_row(db.Row(row.title).id(panel_id))
        for p in row.panels:
            panel_id += 1
            builder: Any
            if p.kind == "timeseries":
                builder = (
                    timeseries.Panel()
                    .legend(
                        cb.VizLegendOptions()
                        .display_mode(cm.LegendDisplayMode.LIST)
                        .placement(cm.LegendPlacement.BOTTOM)
                        .show_legend(True)
                    )
                    .tooltip(
                        cb.VizTooltipOptions()
                        .mode(cm.TooltipDisplayMode.MULTI)
                        .sort(cm.SortOrder.DESCENDING)
                    )
                    .line_width(1)
                    .fill_opacity(0)
                    .span_nulls(False)
                )
                if p.log_scale:
                    builder = builder.scale_distribution(
                        cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(2)
                    )
                if p.thresholds:
                    builder = builder.thresholds_style(
                        cb.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.DASHED)
                    )
                for legend in p.dashed_series:
                    builder = builder.override_by_name(
                        legend,
                        [
                            dm.DynamicConfigValue(
                                "custom.lineStyle", {"fill": "dash", "dash": [10, 10]}
                            ),
                            dm.DynamicConfigValue(
                                "color", {"mode": "fixed", "fixedColor": "red"}
                            ),
                        ],
                    )
            elif p.kind == "heatmap":
                # Bucket heatmaps: y = le, cells = counts. Rank heatmaps: y = rank, cells = value.
                buckets = p.queries[0].fmt == "heatmap"
                builder = (
                    heatmap.Panel()
                    .calculate(False)
                    .color(
                        heatmap.HeatmapColorOptions()
                        .mode(_heatmap_enum("HeatmapColorMode", "SCHEME"))
                        .scheme("Oranges")
                        .scale(_heatmap_enum("HeatmapColorScale", "EXPONENTIAL"))
                        .exponent(0.5)
                        .steps(64)
                    )
                    .y_axis(heatmap.YAxisConfig().unit(p.unit if buckets else "none"))
                    .cell_values(heatmap.CellValues().unit("short" if buckets else p.unit))
                    .show_tooltip()
                    .show_legend()
                )
                if buckets:
                    builder = builder.rows_frame(
                        heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE)
                    )
                else:
                    builder = builder.rows_frame(
                        heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.UNKNOWN)
                    )
            elif p.kind == "table":
                builder = table.Panel()
                if p.hide_columns:
                    builder = builder.with_transformation(
                        dm.DataTransformerConfig(
                            id_val="organize",
                            options={"excludeByName": {c: True for c in p.hide_columns}},
                        )
                    )
                if p.rank_links:
                    builder = builder.override_by_name(
                        "rank",
                        [
                            dm.DynamicConfigValue(
                                "links",
                                [
                                    {
                                        "title": "Rank detail: rank ${__value.raw}",
                                        "url": f"/d/{DETAIL_UID}/ddpmon-rank-detail?"
                                        "var-datasource=${datasource}&var-run=${run}"
                                        "&var-rank=${__value.raw}&${__url_time_range}",
                                    }
                                ],
                            )
                        ],
                    )
            elif p.kind == "stat":
                builder = stat.Panel()
            else:
                raise ValueError(f"panel {p.title!r}: unknown kind {p.kind!r}")
            builder = (
                builder.id(panel_id)
                .title(p.title)
                .description(p.description)
                .datasource(ds)
                .unit(p.unit)
                .span(p.width)
                .height(p.height)
            )
            steps = [dm.Threshold(None, "green"), *(dm.Threshold(v, c) for v, c in p.thresholds)]
            builder = builder.thresholds(
                db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)
            )
            for i, query in enumerate(p.queries):
                target = (
                    prometheus.Dataquery()
                    .ref_id(chr(ord("A") + i))
                    .expr(query.expr)
                    .legend_format(query.legend or "__auto")
                    .format(pm.PromQueryFormat(query.fmt))
                )
                target = target.instant() if query.instant else target.range()
                builder = builder.with_target(target)
            dash = dash.with_panel(builder)

    out = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    _post_process(out, spec)
    return out


def _heatmap_enum(name: str, member: str) -> Any:
    from grafana_foundation_sdk.models import heatmap as hm

    return getattr(getattr(hm, name), member)


def _post_process(out: dict[str, Any], spec: DashboardSpec) -> None:
    """Fill in what the SDK does not model: annotation title formats and field data links."""
    by_name = {name: title for name, _c, _e, title in spec.annotations}
    for ann in out.get("annotations", {}).get("list", []):
        if ann.get("name") in by_name:
            ann["titleFormat"] = by_name[ann["name"]]
            ann["tagKeys"] = "rank,severity"
            ann["step"] = "$__interval"
    panel_specs = {p.title: p for row in spec.rows for p in row.panels}
    for panel in out.get("panels", []):
        ps = panel_specs.get(panel.get("title"))
        if ps is None or panel.get("type") == "row":
            continue
        fc = panel.setdefault("fieldConfig", {"defaults": {}, "overrides": []})
        if ps.rank_links and ps.kind == "timeseries":
            fc["defaults"]["links"] = [_rank_link()]
        if panel.get("options") is None:
            panel["options"] = {}


def render_all(cfg: MixinConfig | None = None) -> dict[str, dict[str, Any]]:
    """``{filename: dashboard JSON}`` for both dashboards."""
    cfg = cfg or MixinConfig()
    return {FILENAMES[s.uid]: _render(s, cfg) for s in specs(cfg)}


def dumps(dashboard: Mapping[str, Any]) -> str:
    """Stable serialisation: sorted keys, two-space indent, trailing newline."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Queries with variables resolved (live test, benchmark)

_VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def _format_value(value: str | Sequence[str], all_value: str | None) -> str:
    if isinstance(value, str):
        if value in ("$__all", "All") and all_value is not None:
            return all_value
        return value
    values = list(value)
    if len(values) == 1:
        return _REGEX_SPECIAL.sub(r"\\\1", values[0])
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", v) for v in values) + ")"


def resolve(expr: str, variables: Mapping[str, Any], *, all_values: Mapping[str, str]) -> str:
    """Substitute dashboard variables the way Grafana's Prometheus data source does:
    a multi-value selection becomes a regex alternation ``(a|b)``, "All" becomes the
    variable's ``allValue``. Unknown variables raise so a query never runs half-resolved."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name[0].isdigit():  # a label_replace capture group such as "$1", not a variable
            return m.group(0)
        if name not in variables:
            raise KeyError(f"variable ${name} has no value in {sorted(variables)}")
        return _format_value(variables[name], all_values.get(name))

    return _VAR_RE.sub(sub, expr)


def panel_queries(
    dashboard: Mapping[str, Any],
    variables: Mapping[str, Any],
    *,
    rate_interval: str = "2m",
    interval: str = "30s",
    range_: str = "1h",
) -> list[PanelQuery]:
    """Every panel query of ``dashboard`` (JSON) with ``variables`` resolved.

    ``variables`` maps ``run``/``rank`` to a value, a list of values, or ``"All"``;
    ``$__rate_interval``, ``$__interval`` and ``$__range`` take the keyword values (Grafana
    derives them from the scrape interval and the panel's step)."""
    all_values = {
        v["name"]: v["allValue"]
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("includeAll") and v.get("allValue")
    }
    env = {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
        **variables,
    }
    coverage = {
        (p.title, chr(ord("A") + i)): query.coverage
        for s in specs()
        if s.uid == dashboard.get("uid")
        for row in s.rows
        for p in row.panels
        for i, query in enumerate(p.queries)
    }
    out: list[PanelQuery] = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if not target.get("expr") or target.get("hide"):
                continue
            ref = target.get("refId", "")
            out.append(
                PanelQuery(
                    panel["title"],
                    resolve(target["expr"], env, all_values=all_values),
                    ref,
                    bool(target.get("instant")) and not target.get("range"),
                    coverage.get((panel["title"], ref), RUN),
                )
            )
    return out


def annotation_queries(
    dashboard: Mapping[str, Any], variables: Mapping[str, Any], *, rate_interval: str = "2m"
) -> list[tuple[str, str]]:
    """``(annotation name, expr)`` for every Prometheus annotation, variables resolved."""
    env = {"__rate_interval": rate_interval, "__interval": "30s", **variables}
    return [
        (a["name"], resolve(a["expr"], env, all_values={"rank": ".*"}))
        for a in dashboard.get("annotations", {}).get("list", [])
        if a.get("expr")
    ]


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for panel in panels:
        if panel.get("type") == "row":
            yield from _panels(panel.get("panels", []))
        else:
            yield panel
