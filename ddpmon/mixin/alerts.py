"""Alert rules of DESIGN.md §5, generated from a :class:`MixinConfig`.

Every alert has ``severity``, ``for``, a static ``summary`` ending in a period, a templated
``description`` naming the run and the rank(s), and ``runbook_url`` pointing at its heading in
``deploy/prometheus/runbook.md``. Groups follow the layers: numerics, data supply, memory,
communication (hangs, lost ranks, stragglers, all-reduce).

Per-rank alerts carry ``run`` and ``rank`` (plus the target labels). Alerts about a run as a
whole carry only ``run``: DdpmonNonFiniteGradients (one page per run; the description lists the
*origin* ranks, those whose local gradients were non-finite before the all-reduce, because after
the all-reduce every rank sees the NaN), DdpmonGradNormSpike, DdpmonGradDesync,
DdpmonDuplicateDataShards (a duplicated shard always involves two or more ranks: one page lists
them all) and DdpmonRanksMissing (which lists the ranks that stopped reporting).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpmon.mixin import names as r
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

NUMERICS, DATA, MEMORY, COMMUNICATION = "numerics", "data", "memory", "communication"
LAYERS = (NUMERICS, DATA, MEMORY, COMMUNICATION)


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    layer: str
    severity: str
    expr: str
    for_: str
    summary: str
    description: str

    def rule(self, cfg: MixinConfig) -> dict:
        if not self.summary.endswith("."):
            raise ValueError(f"{self.name}: summary must end with a period")
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{cfg.runbook_base_url}#{self.name.lower()}",
            },
        }


RANK = "Rank {{ $labels.rank }} of run {{ $labels.run }}"


def _rank_list(query: str) -> str:
    """Go template listing the ``rank`` labels of a PromQL query, sorted, comma separated.

    Each ``%s`` in ``query`` is filled with the alert's ``run`` label.
    """
    args = " $labels.run" * query.count("%s")
    return (
        f'{{{{ range $i, $s := query (printf `{query}`{args}) | sortByLabel "rank" }}}}'
        "{{ if $i }}, {{ end }}{{ $s.Labels.rank }}{{ else }}none{{ end }}"
    )


def alerts(cfg: MixinConfig) -> list[Alert]:
    """All alerts, in layer order."""
    c = cfg
    by_run = 'run="%s"'
    origin = (
        f"sum by (rank) (increase({sel(c, 'ddpmon_grad_nonfinite_origin_steps_total', by_run)}"
        f"[{c.nonfinite_window}])) > 0"
    )
    nonfinite = sel(c, "ddpmon_grad_nonfinite_steps_total")
    origin_sel = sel(c, "ddpmon_grad_nonfinite_origin_steps_total")
    norm = sel(c, "ddpmon_grad_norm", by_run)
    extremes = f"topk(1, {norm}) or bottomk(1, {norm})"
    largest_local = f"topk(1, {sel(c, 'ddpmon_grad_local_norm', by_run)} < +Inf)"

    def identical(extra: str = "") -> str:
        return (
            f"changes({sel(c, 'ddpmon_data_identical_batches_total', extra)}"
            f"[{c.data_duplicate_window}]) >= {c.data_duplicate_min_samples}"
        )

    missing = (
        f"group by (rank) (last_over_time({sel(c, 'ddpmon_world_size', by_run)}"
        f"[{c.missing_lookback}])) unless on (rank) "
        f"group by (rank) ({sel(c, 'ddpmon_world_size', by_run)})"
    )
    return [
        # --- numerics ---
        Alert(
            "DdpmonLossScaleAtFloor", NUMERICS, "critical",
            f"{sel(c, 'ddpmon_amp_loss_scale')}\n<=\n{sel(c, 'ddpmon_amp_loss_scale_floor')}",
            c.loss_scale_floor_for,
            "AMP loss scale is at its floor; fp16 training has stopped making progress.",
            f"{RANK}: the GradScaler loss scale is {{{{ $value }}}}, at or below the floor the "
            "agent was configured with; every step overflows and is skipped.",
        ),
        Alert(
            "DdpmonLossScaleCollapsing", NUMERICS, "warning",
            f"increase({sel(c, 'ddpmon_amp_skipped_steps_total')}[{c.loss_scale_collapse_window}])"
            f"\n/\nincrease({sel(c, 'ddpmon_steps_total')}[{c.loss_scale_collapse_window}])"
            f"\n> {c.loss_scale_collapse_ratio:g}",
            c.loss_scale_collapse_for,
            "Most optimizer steps are being skipped by the AMP GradScaler.",
            f"{RANK}: {{{{ $value | humanizePercentage }}}} of the steps in the last "
            f"{c.loss_scale_collapse_window} were skipped for inf/NaN gradients; the loss scale "
            "is collapsing.",
        ),
        Alert(
            "DdpmonNonFiniteGradients", NUMERICS, "critical",
            # Fires as soon as an origin rank is scraped (so the page names it), or after
            # `nonfinite_origin_wait` without one: ranks are scraped at different moments.
            f"count by (run) (increase({nonfinite}[{c.nonfinite_window}]) > 0)\n"
            f"and on (run) (\n"
            f"  count by (run) (increase({origin_sel}[{c.nonfinite_window}]) > 0)\n"
            f"  or\n"
            f"  count by (run) (increase({nonfinite}[{c.nonfinite_window}] "
            f"offset {c.nonfinite_origin_wait}) > 0)\n)",
            c.nonfinite_for,
            "Gradients became NaN/Inf after the all-reduce.",
            "Run {{ $labels.run }}: reduced gradients were non-finite on {{ $value }} rank(s) in "
            f"the last {c.nonfinite_window}. Origin rank(s), whose local gradients were "
            f"non-finite before the all-reduce: {_rank_list(origin)}.",
        ),
        Alert(
            "DdpmonNonFiniteLoss", NUMERICS, "critical",
            f"increase({sel(c, 'ddpmon_loss_nonfinite_total')}[{c.nonfinite_window}]) > 0",
            c.nonfinite_for,
            "The training loss became NaN/Inf.",
            f"{RANK}: the observed loss was non-finite in the last {c.nonfinite_window}.",
        ),
        Alert(
            "DdpmonGradNormSpike", NUMERICS, "warning",
            f"{r.GRAD_NORM_RUN_MAX}\n>\n{c.grad_norm_spike_factor:g} * "
            f"quantile_over_time(0.5, {r.GRAD_NORM_RUN_MAX}[{c.grad_norm_spike_baseline}])",
            c.grad_norm_spike_for,
            "Gradient norm is far above its recent baseline.",
            "Run {{ $labels.run }}: the global gradient norm is {{ $value | humanize }}, more "
            f"than {c.grad_norm_spike_factor:g}x its {c.grad_norm_spike_baseline} median. "
            f"Largest local (pre-all-reduce) norm on rank {_rank_list(largest_local)}.",
        ),
        Alert(
            "DdpmonGradDesync", NUMERICS, "critical",
            f"{r.GRAD_NORM_RUN_SPREAD} > {c.grad_desync_relative:g}",
            c.grad_desync_for,
            "Post-all-reduce gradient norms differ across ranks; replicas have diverged.",
            "Run {{ $labels.run }}: at the same step, the reduced gradient norms of its ranks "
            "differ by {{ $value | humanizePercentage }} (allowed "
            f"{c.grad_desync_relative:g}); the model replicas are no longer identical. "
            f"Ranks with the highest and lowest norm: {_rank_list(extremes)}.",
        ),
        # --- data supply ---
        Alert(
            "DdpmonDuplicateDataShards", DATA, "warning",
            # changes(), not increase(): it counts scrapes at which the counter grew, exactly,
            # where increase() extrapolates one increment to more than 1.
            f"count by (run) (\n  {identical()}\n)",
            c.data_duplicate_for,
            "Ranks are training on identical batches; data shards are duplicated.",
            "Run {{ $labels.run }}: {{ $value }} rank(s) computed local gradients bit-identical "
            "to another rank's at sampled steps of the last "
            f"{c.data_duplicate_window}, so they were fed the same batches. Ranks: "
            f"{_rank_list(identical(by_run))}.",
        ),
        # --- memory ---
        Alert(
            "DdpmonGpuMemoryNearlyFull", MEMORY, "warning",
            f"{sel(c, 'ddpmon_gpu_memory_used_bytes')}\n/\n"
            f"{sel(c, 'ddpmon_gpu_memory_total_bytes')}\n> {c.gpu_memory_full_ratio:g}",
            c.gpu_memory_full_for,
            "GPU memory is nearly full.",
            f"{RANK}: GPU {{{{ $labels.gpu }}}} is {{{{ $value | humanizePercentage }}}} full "
            f"(threshold {c.gpu_memory_full_ratio:.0%}).",
        ),
        Alert(
            "DdpmonCudaOOM", MEMORY, "warning",
            f"increase({sel(c, 'ddpmon_cuda_ooms_total')}[{c.cuda_oom_window}])\n+\n"
            f"increase({sel(c, 'ddpmon_cuda_alloc_retries_total')}[{c.cuda_oom_window}])\n> 0",
            c.cuda_oom_for,
            "The CUDA caching allocator ran out of memory or had to retry.",
            f"{RANK}: the CUDA caching allocator hit out-of-memory errors or had to free its "
            f"cache and retry in the last {c.cuda_oom_window}.",
        ),
        # --- communication: hangs, lost ranks, stragglers, all-reduce ---
        Alert(
            "DdpmonTrainingStalled", COMMUNICATION, "critical",
            f"time() - {sel(c, 'ddpmon_last_step_timestamp_seconds')} > {c.stall_seconds:g}\n"
            f"and\n{sel(c, 'ddpmon_last_step_timestamp_seconds')} > 0",
            c.stall_for,
            "Training has not completed a step for too long; it is probably hung.",
            f"{RANK} has not completed a step for {{{{ $value | humanizeDuration }}}} "
            f"(threshold {c.stall_seconds:g}s).",
        ),
        Alert(
            "DdpmonRankDown", COMMUNICATION, "critical",
            f"{sel(c, 'up')} == 0",
            c.rank_down_for,
            "A training rank cannot be scraped.",
            f"{RANK} ({{{{ $labels.instance }}}}) cannot be scraped: the process died, hung "
            "hard or is unreachable.",
        ),
        Alert(
            "DdpmonRanksMissing", COMMUNICATION, "critical",
            f"{r.WORLD_SIZE} - {r.RANKS_REPORTING} > 0",
            c.ranks_missing_for,
            "Fewer ranks report than the run's world size.",
            "Run {{ $labels.run }}: {{ $value }} rank(s) of its world size are not reporting. "
            f"Ranks seen in the last {c.missing_lookback} that stopped: {_rank_list(missing)}.",
        ),
        Alert(
            "DdpmonRankDesync", COMMUNICATION, "warning",
            f"max by (run) ({sel(c, 'ddpmon_step')})\n- on (run) group_right\n"
            f"{sel(c, 'ddpmon_step')}\n> {c.rank_desync_steps:g}",
            c.rank_desync_for,
            "Ranks of a run are at very different steps.",
            f"{RANK} is {{{{ $value }}}} steps behind the most advanced rank of the run.",
        ),
        Alert(
            "DdpmonStraggler", COMMUNICATION, "warning",
            f"{r.COMPUTE_MEAN}\n> on (run) group_left ()\n"
            f"({c.straggler_ratio:g} * {r.COMPUTE_RUN_MEDIAN})",
            c.straggler_for,
            "A rank computes much slower than the others and holds the run back.",
            f"{RANK} spends {{{{ $value | humanizeDuration }}}} per step outside the all-reduce, "
            f"more than {c.straggler_ratio:g}x the run's median rank.",
        ),
        Alert(
            "DdpmonAllReduceSlow", COMMUNICATION, "warning",
            f"{r.ALLREDUCE_P99}\n>\n{c.allreduce_slow_factor:g} * quantile_over_time(0.5, "
            f"{r.ALLREDUCE_P99}[{c.allreduce_slow_baseline}])\n"
            f"and\n{r.ALLREDUCE_P99} > {c.allreduce_slow_min_seconds:g}",
            c.allreduce_slow_for,
            "All-reduce latency is far above its baseline.",
            f"{RANK}: all-reduce p99 is {{{{ $value | humanizeDuration }}}}, more than "
            f"{c.allreduce_slow_factor:g}x its {c.allreduce_slow_baseline} median.",
        ),
    ]


def alert_groups(cfg: MixinConfig) -> list[dict]:
    """Rule groups in Prometheus' rule file shape, one per layer."""
    all_alerts = alerts(cfg)
    return [
        {
            "name": f"ddpmon-{layer}.alerts",
            "rules": [a.rule(cfg) for a in all_alerts if a.layer == layer],
        }
        for layer in LAYERS
    ]
