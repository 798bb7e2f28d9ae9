"""The dashboards as plain data: what a panel shows and what its queries must return.

Layout modules (``overview.py``, ``detail.py``) build these from the named queries in
``queries/``; ``grafana.py`` renders them with grafana-foundation-sdk. The live test and the
1024-rank benchmark read the ``coverage`` of each query to know whether it must return a series
for every rank, for the run, only after a fault, or only on a GPU node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
QUIET = "quiet"
"""Has no data in a healthy run (down or missing ranks): the live test asserts it is empty."""
ANY = "any"
"""May be empty in a live run (per-rank alerts that take minutes to fire, norms compared at the
same step): the live test only checks that it runs."""
COVERAGES = (EVERY_RANK, RUN, FAULT, DUP_DATA, GPU, DCGM, QUIET, ANY)

EXEMPT_REASONS = {
    GPU: "needs a CUDA device: torch allocator statistics and NVML readings do not exist on CPU",
    DCGM: "needs dcgm-exporter on a GPU node; joined to ranks by gpu_uuid",
}


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
    base_color: str = "green"
    """Colour below the first threshold (red for "higher is better" stats)."""
    columns: tuple[tuple[str, str], ...] = ()
    """Table: merge the queries into one row per rank and rename ``Value #<refId>`` columns,
    ``(refId, name)``."""
    sort_by: str = ""
    """Table: the column sorted descending (worst first)."""
    distribution: bool = False
    """Heatmap: Grafana bins the per-rank values (y = value bucket, colour = number of ranks),
    which stays readable at 1024 ranks where one row per rank would not."""


@dataclass(frozen=True, slots=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


@dataclass(frozen=True, slots=True)
class Annotation:
    """A Prometheus annotation drawn on every panel."""

    name: str
    color: str
    expr: str
    title: str
    """Grafana title format, e.g. ``{{alertname}}``."""


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: tuple[RowSpec, ...]
    rank_multi: bool
    annotations: tuple[Annotation, ...] = field(default=())
