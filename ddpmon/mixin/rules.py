"""Recording rules: per-rank and per-run aggregates that alerts and dashboards share.

Names (``ddpmon/mixin/names.py``) follow Prometheus' ``level:metric:operations``. A ``run:``
median of a ``rank:`` record reads that record (one level of nesting, never more; a record
comes after its inputs in its group); ``dependent`` tells such rules apart, for backfills. Per-rank
records aggregate nothing away, so every target label survives (job, instance, namespace,
cluster, node...); per-run records aggregate ``by`` ``MixinConfig.run_labels``. Rates use
``MixinConfig.rate_window``. Quantile records drop NaN (no observations in the window) so that
``quantile_over_time`` baselines over them stay finite.
"""

from __future__ import annotations

import re

from ddpmon import metrics as m
from ddpmon.mixin import names as n
from ddpmon.mixin import stragglers
from ddpmon.mixin.config import MixinConfig


def sel(cfg: MixinConfig, metric: str, extra: str = "") -> str:
    """``metric{<job selector>[,extra]}``."""
    matchers = ",".join(x for x in (cfg.job_selector, extra) if x)
    return f"{metric}{{{matchers}}}"


def grad_norm_by_step(cfg: MixinConfig) -> str:
    """Finite post-reduce norms labelled with the step they belong to.

    ``count_values`` turns each rank's ``ddpmon_step`` value into a ``step`` label so ranks are
    only compared at the same step. Only aggregates of it are recorded: a ``step`` label on a
    stored series would create a new series every step.
    """
    return (
        f"(({sel(cfg, m.GRAD_NORM.name)} < +Inf)"
        f" * on (job, instance) group_left (step)"
        f' count_values without () ("step", {sel(cfg, m.STEP.name)}))'
    )


def _rate(cfg: MixinConfig, metric: str) -> str:
    return f"rate({sel(cfg, metric)}[{cfg.rate_window}])"


def _mean(cfg: MixinConfig, histogram: str) -> str:
    return f"{_rate(cfg, histogram + '_sum')}\n/\n{_rate(cfg, histogram + '_count')}"


def _quantile(cfg: MixinConfig, q: str, histogram: str, by: str = "") -> str:
    """Per rank (no ``by``: rate of each bucket series keeps its labels) or aggregated."""
    buckets = _rate(cfg, histogram + "_bucket")
    if by:
        buckets = f"sum by ({by}, le) ({buckets})"
    return f"histogram_quantile({q}, {buckets}) >= 0"


def dependent(expr: str) -> bool:
    """True when ``expr`` reads another recording rule's output (a second-order rule)."""
    return bool(re.search(r"\b(?:rank|run):ddpmon_", expr))


def _median(cfg: MixinConfig, expr: str, by: str = "") -> str:
    return f"quantile {by or cfg.by_run} (0.5, {expr})"


RANK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1, 2.5, 5, 10, 25, 60)
"""Upper bounds (seconds) of the run-wide distributions of per-rank latencies."""


def _ranks_bucket(cfg: MixinConfig, record: str, by: str = "") -> str:
    """Per run (or ``by``), how many ranks have ``record`` <= each bound, as cumulative ``le``
    buckets (0 where none is), so a heatmap reads len(RANK_BUCKETS) + 1 series per group
    whatever the rank count."""
    by = by or cfg.by_run
    terms = [
        f'label_replace(count {by} ({record} <= {b:g}) or count {by} ({record}) * 0, '
        f'"le", "{b:g}", "", "")'
        for b in RANK_BUCKETS
    ]
    terms.append(f'label_replace(count {by} ({record} >= 0), "le", "+Inf", "", "")')
    return "\nor\n".join(terms)


def _problem(name: str, expr: str) -> str:
    return f'label_replace({expr}, "problem", "{name}", "", "")'


def rank_problems(cfg: MixinConfig) -> str:
    """Per rank, the number of problems the rank-health table names (0 for a healthy rank that
    reports its step). Recorded so the table reads one series per rank: computed per dashboard
    load it took 2.8 s at 16,384 ranks. Reads first-order records and raw series only (the run's
    median compute time inline), so dashboards stay one level of nesting deep."""
    run_labels = ", ".join(cfg.run_labels)
    step = sel(cfg, m.STEP.name)
    behind = f"{n.STEP_LEADER} - on ({run_labels}) group_right {step}"
    problems = "\nor\n".join(
        (
            _problem("down", f"{sel(cfg, 'up')} == 0"),
            _problem("stalled", f"{n.HEARTBEAT_AGE} > {n.STALL_THRESHOLD}"),
            _problem("behind", f"{behind} > {cfg.rank_desync_steps:g}"),
            _problem("straggler", stragglers.problem_expr(cfg)),
            _problem("starved", f"{n.DATA_WAIT_RATIO} > {cfg.data_starved_share:g}"),
            _problem(
                "memory",
                f"max without (gpu) ({n.GPU_ALLOCATED_RATIO}) > {cfg.gpu_memory_full_ratio:g}",
            ),
        )
    )
    return f"count without (problem) (\n{problems}\n)\nor\n{step} * 0"


def recording_rules(cfg: MixinConfig) -> list[dict]:
    """Rule groups in Prometheus' rule file shape, one per layer."""
    return [
        {"name": f"ddpmon-{m.Layer.NUMERICS.slug}.rules", "rules": _numerics_records(cfg)},
        {"name": f"ddpmon-{m.Layer.DATA_SUPPLY.slug}.rules", "rules": _data_records(cfg)},
        {"name": f"ddpmon-{m.Layer.MEMORY.slug}.rules", "rules": _memory_records(cfg)},
        {"name": f"ddpmon-{m.Layer.COMMUNICATION.slug}.rules",
         "rules": _communication_records(cfg)},
    ]


def _numerics_records(cfg: MixinConfig) -> list[dict]:
    by_run = cfg.by_run
    run_labels = ", ".join(cfg.run_labels)
    by_step = grad_norm_by_step(cfg)
    # Steps the loss scaler skipped (its overflows are how fp16 training finds its scale).
    scaler = 'by="scaler"'
    skipped = f"sum without (by) ({sel(cfg, m.STEPS_SKIPPED.name, scaler)})"
    skipped_rate = (
        f"sum without (by) (rate({sel(cfg, m.STEPS_SKIPPED.name, scaler)}[{cfg.rate_window}]))"
    )
    return [
        {
            "record": n.SKIPPED_RATIO,
            "expr": f"{skipped_rate}\n/\n{_rate(cfg, m.STEPS.name)}",
        },
        {
            # Every step the scaler skipped also counts as a non-finite step, so this counter
            # only grows for non-finite steps nothing absorbed (no scaler, bf16, fp32...).
            "record": n.GRAD_UNABSORBED,
            "expr": f"{sel(cfg, m.GRAD_NONFINITE_STEPS.name)}\n-\n"
            f"({skipped} or {sel(cfg, m.GRAD_NONFINITE_STEPS.name)} * 0)",
        },
        {
            # Grows by one for a non-finite loss on a step the scaler did not skip; an
            # absorbed overflow moves both counters (no change) or only the skipped one (down).
            "record": n.LOSS_UNABSORBED,
            "expr": f"{sel(cfg, m.LOSS_NONFINITE.name)}\n-\n"
            f"({skipped} or {sel(cfg, m.LOSS_NONFINITE.name)} * 0)",
        },
        {
            "record": n.GRAD_NORM_RUN_MAX,
            "expr": f"max {by_run} ({sel(cfg, m.GRAD_NORM.name)} < +Inf)",
        },
        {
            "record": n.GRAD_NORM_RUN_SPREAD,
            "expr": f"max {by_run} (\n"
            f"  (max by ({run_labels}, step) ({by_step})"
            f" - min by ({run_labels}, step) ({by_step}))\n"
            f"  / max by ({run_labels}, step) ({by_step})\n"
            f"  and on ({run_labels}, step) (count by ({run_labels}, step) ({by_step}) > 1)\n"
            ")",
        },
        {"record": n.LOSS_RUN_MEDIAN, "expr": _median(cfg, sel(cfg, m.LOSS.name))},
        {
            "record": n.LOCAL_NORM_RUN_MEDIAN,
            "expr": _median(cfg, sel(cfg, m.GRAD_LOCAL_NORM.name)),
        },
    ]


def _data_records(cfg: MixinConfig) -> list[dict]:
    by_run = cfg.by_run
    step_mean, wait_mean = _mean(cfg, m.STEP_DURATION.name), _mean(cfg, m.DATA_WAIT.name)
    gw = cfg.gauge_window
    return [
        {"record": n.STEP_P99, "expr": _quantile(cfg, "0.99", m.STEP_DURATION.name)},
        {"record": n.STEPS_RATE, "expr": _rate(cfg, m.STEPS.name)},
        {"record": n.DATA_WAIT_MEAN, "expr": wait_mean},
        {
            # First-order (raw series only), like every record the dashboards read: the
            # dashboard benchmark backfills them in one pass.
            "record": n.DATA_WAIT_RATIO,
            "expr": f"({wait_mean})\n/\n(({wait_mean})\n+\n({step_mean}))",
        },
        {"record": n.DATA_WAIT_RUN_MEDIAN, "expr": f"quantile {by_run} (0.5, {n.DATA_WAIT_MEAN})"},
        {
            "record": n.HEARTBEAT_AGE,
            "expr": f"time() - max_over_time({sel(cfg, m.LAST_STEP_TIMESTAMP.name)}[{gw}])",
        },
        {
            # The agent exports its stall_seconds; older agents do not: use the config's.
            "record": n.STALL_THRESHOLD,
            "expr": f"max_over_time({sel(cfg, m.STALL_THRESHOLD.name)}[{gw}])\nor\n"
            f"max_over_time({sel(cfg, m.LAST_STEP_TIMESTAMP.name)}[{gw}]) * 0 "
            f"+ {cfg.stall_seconds:g}",
        },
        {"record": n.STEP_LEADER, "expr": f"max {by_run} ({sel(cfg, m.STEP.name)})"},
        {"record": n.STEP_RUN_MIN, "expr": f"min {by_run} ({sel(cfg, m.STEP.name)})"},
        {"record": n.STEPS_RATE_RUN_MEDIAN, "expr": _median(cfg, n.STEPS_RATE)},
        {"record": n.STEP_P99_RUN_MEDIAN, "expr": _median(cfg, n.STEP_P99)},
        {"record": n.DATA_WAIT_RANKS, "expr": _ranks_bucket(cfg, n.DATA_WAIT_MEAN)},
        {"record": n.STEP_P99_RANKS, "expr": _ranks_bucket(cfg, n.STEP_P99)},
        *_throughput_records(cfg),
    ]


def _throughput_records(cfg: MixinConfig) -> list[dict]:
    """The run's tokens/s, achieved FLOP/s and MFU from its ranks' (first-order: raw series)."""
    by_run = cfg.by_run
    exported = f"and on (job, instance) {sel(cfg, m.MFU.name)}"
    return [
        {"record": n.TOKENS_RUN_RATE,
         "expr": f"sum {by_run} ({sel(cfg, m.TOKENS_PER_SECOND.name)})"},
        {"record": n.ACHIEVED_FLOPS_RUN,
         "expr": f"sum {by_run} ({sel(cfg, m.ACHIEVED_FLOPS.name)})"},
        {"record": n.MFU_RUN,
         "expr": f"sum {by_run} ({sel(cfg, m.ACHIEVED_FLOPS.name)} {exported})\n/\n"
                 f"sum {by_run} ({sel(cfg, m.PEAK_FLOPS.name)} {exported})"},
    ]


def _memory_records(cfg: MixinConfig) -> list[dict]:
    gw = cfg.gauge_window
    return [
        {
            "record": n.GPU_ALLOCATED_RATIO,
            # group_right: the result keeps the NVML series' `gpu` label.
            "expr": f"max_over_time({sel(cfg, m.CUDA_MEMORY_ALLOCATED.name)}[{gw}])\n"
            f"/ ignoring (gpu) group_right\n{sel(cfg, m.GPU_MEMORY_TOTAL.name)}",
        },
        {
            "record": n.RSS_RUN_MEDIAN,
            "expr": _median(cfg, sel(cfg, m.PROCESS_RESIDENT_MEMORY.name)),
        },
    ]


def _communication_records(cfg: MixinConfig) -> list[dict]:
    by_run = cfg.by_run
    run_labels = ", ".join(cfg.run_labels)
    collective = m.COLLECTIVE_DURATION.name
    by_op = f"by ({run_labels}, op)"
    return [
        {
            # Per rank and op, exact; NaN (no collective of that op in the window) dropped so
            # the CollectiveSlow baseline (quantile_over_time) stays finite.
            "record": n.COLLECTIVE_MEAN,
            "expr": f"({_mean(cfg, collective)}) >= 0",
        },
        {
            # The overview's per-rank p99: histogram_quantile over raw buckets of 1024 ranks
            # is too slow for a dashboard, a recorded series per rank is not.
            "record": n.COLLECTIVE_P99,
            "expr": _quantile(cfg, "0.99", collective),
        },
        {
            "record": n.COLLECTIVE_RUN_P99,
            "expr": _quantile(cfg, "0.99", collective, f"{run_labels}, op"),
        },
        # Per run and op: the median rank and how many ranks fall in each latency bucket.
        {"record": n.COLLECTIVE_MEAN_RUN_MEDIAN, "expr": _median(cfg, n.COLLECTIVE_MEAN, by_op)},
        {"record": n.COLLECTIVE_P99_RUN_MEDIAN, "expr": _median(cfg, n.COLLECTIVE_P99, by_op)},
        {"record": n.COLLECTIVE_MEAN_RANKS, "expr": _ranks_bucket(cfg, n.COLLECTIVE_MEAN, by_op)},
        {"record": n.COLLECTIVE_P99_RANKS, "expr": _ranks_bucket(cfg, n.COLLECTIVE_P99, by_op)},
        *stragglers.records(cfg),
        {"record": n.RANKS_REPORTING, "expr": f"count {by_run} ({sel(cfg, m.WORLD_SIZE.name)})"},
        {"record": n.WORLD_SIZE, "expr": f"max {by_run} ({sel(cfg, m.WORLD_SIZE.name)})"},
        {"record": n.RANK_PROBLEMS, "expr": rank_problems(cfg)},
    ]
