"""One source of selectors, thresholds and durations for alerts, recording rules and dashboards.

Edit here (or pass a modified copy to the generators), then regenerate with
``ddpmon rules --write`` and ``ddpmon dashboards --write``; CI diffs the committed outputs.
Users override fields without editing code, the way kubernetes-mixin's ``_config`` is
overridden: ``ddpmon rules --write --dir D --config mixin.yaml`` (see :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_DURATION = re.compile(r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$")


@dataclass(kw_only=True, slots=True)
class MixinConfig:
    job_selector: str = 'job="ddpmon"'
    """Selector of the scrape job(s) that hold ddpmon agents."""
    run_labels: list[str] = field(default_factory=lambda: ["cluster", "namespace", "job", "run"])
    """Labels that identify a run: run-wide records and alerts aggregate ``by`` these (absent
    ones are harmless), so they keep cluster, namespace and job; per-rank records aggregate
    nothing away and keep every target label (node, instance, pod...)."""
    alert_rank_cap: int = 5
    """A run-wide alert lists at most this many ranks, worst first."""
    gauge_window: str = "2m"
    """Gauge conditions read ``max_over_time``/``min_over_time`` over this window, so one failed
    scrape does not reset a pending alert."""
    runbook_base_url: str = (
        "https://github.com/ddpmon/ddpmon/blob/main/deploy/prometheus/runbook.md"
    )
    """Alerts link to ``<runbook_base_url>#<alertname lower-case>``."""

    rate_window: str = "5m"
    """Window of ``rate()``/``increase()`` in the recording rules (step time, all-reduce p99...)."""
    missing_lookback: str = "1h"
    """DdpmonRanksMissing names the ranks seen within this window that stopped reporting."""

    hang_for: str = "0s"
    """DdpmonHangHolder's ``for``: the agent already waited its ``hang_seconds`` (30 s by
    default) before it exports a stuck rank, so the page comes within a minute."""

    # --- numerics ---
    loss_scale_floor_for: str = "1m"
    loss_scale_collapse_ratio: float = 0.5
    """Fraction of steps skipped by the scaler over ``loss_scale_collapse_window`` that warns."""
    loss_scale_collapse_window: str = "5m"
    loss_scale_collapse_for: str = "2m"
    nonfinite_window: str = "5m"
    """A non-finite gradient or loss keeps its alert firing for this long after the step."""
    nonfinite_for: str = "0m"
    nonfinite_persistent_steps: int = 20
    """DdpmonNonFiniteGradients also fires when a rank had more non-finite steps than this in
    ``nonfinite_persistent_window``, absorbed or not (a scaler that keeps skipping; with a loss
    scale floor, DdpmonLossScaleAtFloor fires first and inhibits it)."""
    nonfinite_persistent_window: str = "10m"
    nonfinite_origin_wait: str = "1m"
    """DdpmonNonFiniteGradients fires once an origin rank is scraped, or after this long without
    one (ranks are scraped at different moments; the page should name the origin)."""
    grad_norm_spike_factor: float = 10.0
    """Norm above this multiple of its own median over ``grad_norm_spike_baseline`` is a spike.
    A median baseline keeps a spike from becoming its own baseline until it lasts half the
    window."""
    grad_norm_spike_baseline: str = "30m"
    grad_norm_spike_for: str = "2m"
    loss_spike_for: str = "0m"
    """DdpmonLossSpike: the agent already waited ``spike_recover_steps`` steps for the spike to
    recover before it set ``ddpmon_loss_spike_unrecovered_step``; no second wait."""
    grad_desync_relative: float = 1e-3
    """Relative spread of post-reduce norms across ranks of a run that means replicas diverged."""
    grad_desync_for: str = "5m"
    grad_norm_mismatch_window: str = "10m"
    grad_norm_mismatch_for: str = "3m"
    replica_mismatch_window: str = "15m"
    """DdpmonReplicaDiverged: a replica mismatch counted in this window (longer than a check
    interval's worth of steps at your step rate), or a mismatch counter younger than it that
    is already non-zero (the first check can come before Prometheus's first scrape)."""
    replica_mismatch_for: str = "0m"

    # --- data supply / liveness ---
    stall_seconds: float = 300.0
    """Fallback stall threshold for agents that do not export ``ddpmon_stall_threshold_seconds``
    (the agent's own ``stall_seconds``)."""
    stall_for: str = "1m"
    first_step_seconds: float = 900.0
    """DdpmonNoFirstStep: a rank attached this long ago has not completed a step (stuck in
    init, rendezvous, compilation or the first all-reduce)."""
    first_step_for: str = "1m"
    rank_down_for: str = "2m"
    ranks_missing_for: str = "2m"
    rank_desync_steps: float = 50.0
    rank_desync_for: str = "10m"
    data_duplicate_window: str = "15m"
    data_duplicate_min_samples: int = 2
    """DdpmonDuplicateDataShards needs a rank's ``ddpmon_data_identical_batches_total`` to have
    grown at this many distinct scrapes within ``data_duplicate_window``: a duplicated shard
    repeats at every sampled step (every ``data_check_interval`` steps), while one identical
    warm-up batch fed to every rank counts once and must not page."""
    data_duplicate_for: str = "5m"
    data_starved_factor: float = 3.0
    """DdpmonDataStarved: a rank's mean data wait above this multiple of the run median..."""
    data_starved_share: float = 0.2
    """...and above this share of its iterations (data wait + step time)."""
    data_starved_for: str = "10m"

    # --- communication ---
    straggler_slowdown: float = 0.05
    """A rank whose own time per step (step time and data wait, less its wait inside
    collectives) is this much above the run's median rank's (0.05: 5 % slower) is a straggler
    (``ddpmon.mixin.stragglers``)..."""
    straggler_min_seconds: float = 0.002
    """...and at least this many seconds per step above it (microsecond steps are noise)."""
    straggler_window: str = "1m"
    """The rate window of the straggler records: short, so that a straggler is named soon (a
    5 % straggler within about 30 steps of 2 s among 1,024 ranks, ``benchmarks/
    straggler_scale.py``); 4 scrapes at 15 s, 12 at the shipped 5 s. It must hold at least two
    scrapes, or the records are empty: with Prometheus's default 60 s scrape interval, set it
    to 2m or more."""
    straggler_for: str = "3m"
    """The alert pages once a rank has been named this long: a page waits for a slowdown that
    lasts, the naming (records, dashboards, ``ddpmon top``) does not."""
    collective_slow_factor: float = 4.0
    collective_slow_baseline: str = "1h"
    """A rank's mean collective time (per op) is compared with its own median over this
    window."""
    collective_slow_min_seconds: float = 0.005
    """A mean collective time below this is never slow (4x of microseconds is noise)."""
    collective_slow_for: str = "10m"

    # --- memory ---
    gpu_memory_full_ratio: float = 0.95
    """Highest allocator-allocated bytes (live tensors) over ``gauge_window`` above this share of
    the device (NVML total). Not NVML "used" nor allocator "reserved": both include the caching
    allocator's free blocks and read near 100% on a well-tuned job."""
    gpu_memory_full_for: str = "5m"
    cuda_oom_window: str = "10m"
    cuda_oom_for: str = "0m"
    cuda_retry_min: int = 5
    """DdpmonCudaAllocRetries: at least this many allocator retries (cache flushed and cudaMalloc
    retried under memory pressure) in ``cuda_retry_window``."""
    cuda_retry_window: str = "15m"
    cuda_retry_for: str = "15m"

    # --- the agent itself ---
    agent_errors_window: str = "5m"
    """DdpmonAgentUnhealthy: probe errors in every window of this length for
    ``agent_unhealthy_for`` (errors that keep coming; one failure does not page)."""
    agent_unhealthy_for: str = "10m"

    # --- checkpoints (ranks that report them) ---
    checkpoint_stale_seconds: float = 3600.0
    """DdpmonCheckpointStale: no checkpoint saved for this long while steps still complete."""
    checkpoint_stale_for: str = "5m"
    checkpoint_slow_share: float = 0.1
    """DdpmonCheckpointSlow: saves above this share of the wall time over the window."""
    checkpoint_slow_window: str = "30m"
    checkpoint_slow_for: str = "5m"

    # --- goodput (rank 0 exports it; goodput_seconds > 0) ---
    goodput_floor: float = 0.5
    """DdpmonGoodputLow: productive step time below this share of the wall-clock time over
    ``goodput_window``."""
    goodput_window: str = "1h"
    goodput_for: str = "15m"

    # --- dashboards ---
    dashboard_topk: int = 10
    """Per-rank panels draw the top/bottom k ranks; quantiles/heatmaps show the rest."""
    dashboard_tags: list[str] = field(default_factory=lambda: ["ddpmon"])
    dashboard_refresh: str = "30s"
    dashboard_selector: str = ""
    """Extra label matchers (without braces) on every dashboard query and variable, e.g.
    ``cluster="prod"``, for a Prometheus that holds several clusters' ranks."""
    dashboard_datasource: str = ""
    """Name of the Prometheus data source the ``datasource`` variable selects by default; empty
    leaves Grafana's default data source."""
    dashboard_dcgm_selector: str = ""
    """Label matchers (without braces) for dcgm-exporter series on Rank detail, e.g.
    ``job="dcgm-exporter"``. Empty by default: ``DCGM_FI_*`` names are unique to dcgm-exporter
    and the join on ``gpu_uuid`` already picks the rank's GPU, whatever the scrape job is called
    (kube-prometheus-stack, the dcgm-exporter Helm chart and static configs all differ)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name.endswith(("_for", "_window", "_baseline", "_lookback", "_wait"))
                    and not (isinstance(value, str) and _DURATION.match(value))):
                raise ValueError(f"{f.name}={value!r}: expected a duration like 30s or 5m")
        for name in ("data_duplicate_min_samples", "alert_rank_cap", "cuda_retry_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected >= 1")
        if self.checkpoint_stale_seconds <= 0:
            raise ValueError(
                f"checkpoint_stale_seconds={self.checkpoint_stale_seconds!r}: expected > 0"
            )
        if "run" not in self.run_labels:
            raise ValueError(f"run_labels={self.run_labels!r}: must include 'run'")
        for name in ("job_selector", "dashboard_selector", "dashboard_dcgm_selector"):
            if getattr(self, name).strip().startswith("{"):
                raise ValueError(f"{name}: give label matchers without braces")
        for name in ("loss_scale_collapse_ratio", "gpu_memory_full_ratio", "data_starved_share",
                     "checkpoint_slow_share", "goodput_floor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a ratio in (0, 1]")

    @property
    def by_run(self) -> str:
        """``by (<run labels>)`` for run-wide aggregations."""
        return f"by ({', '.join(self.run_labels)})"

    @property
    def on_run(self) -> str:
        """``on (<run labels>)`` for joins between run-wide vectors."""
        return f"on ({', '.join(self.run_labels)})"

    def replace(self, **changes: object) -> MixinConfig:
        """A copy with some fields changed (tests shorten ``*_for`` durations this way)."""
        return dataclasses.replace(self, **changes)


RENAMED_FIELDS = {
    "allreduce_slow_factor": "collective_slow_factor",
    "allreduce_slow_baseline": "collective_slow_baseline",
    "allreduce_slow_min_seconds": "collective_slow_min_seconds",
    "allreduce_slow_for": "collective_slow_for",
}
"""Old field names a config file may still use (old -> new; see docs/architecture.md)."""


def load_config(path: str | Path) -> MixinConfig:
    """A :class:`MixinConfig` from a YAML mapping of field names to values (unknown names and
    bad values are errors that name the file and the field)."""

    path = Path(path)
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read mixin config: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of MixinConfig fields")
    for old, new in RENAMED_FIELDS.items():
        if old in data:
            if new in data:
                raise ValueError(f"{path}: {old} is the old name of {new}: give one of them")
            data[new] = data.pop(old)
    known = {f.name: f for f in dataclasses.fields(MixinConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known: {sorted(known)}")
    for name, value in data.items():
        default = getattr(MixinConfig(), name)
        ok = isinstance(value, type(default)) or (isinstance(default, float) and type(value) is int)
        if not ok:
            raise ValueError(f"{path}: {name}={value!r}: expected {type(default).__name__}")
    try:
        return MixinConfig(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
