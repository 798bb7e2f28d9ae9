"""Recording rules: per-run and per-rank aggregates that alerts and dashboards share.

Names follow the mixin convention ``ddpmon:<metric>:<operation>``; ``run_`` in the operation
means the aggregate is across the ranks of a run (labels ``run`` and, where stated, ``quantile``),
otherwise it is per rank (labels ``run``, ``rank``). Rates use ``MixinConfig.rate_window``.
Quantile records drop NaN (no observations in the window) so that ``avg_over_time`` baselines
over them stay finite.
"""

from __future__ import annotations

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.names import (
    ALLREDUCE_P50,
    ALLREDUCE_P99,
    ALLREDUCE_PER_STEP,
    ALLREDUCE_RUN_P99,
    COMPUTE_MEAN,
    COMPUTE_RUN_MEDIAN,
    DATA_WAIT_MEAN,
    GPU_MEMORY_RATIO,
    GRAD_NORM_RUN_MAX,
    GRAD_NORM_RUN_SPREAD,
    RANKS_REPORTING,
    SKIPPED_RATIO,
    STEP_MEAN,
    STEP_P99,
    STEP_RUN_QUANTILE,
    STEPS_RATE,
    WORLD_SIZE,
)

RUN_QUANTILES = ("0.5", "0.9", "0.99")
"""Cross-rank quantiles recorded for per-rank mean step time."""

def sel(cfg: MixinConfig, metric: str, extra: str = "") -> str:
    """``metric{<job selector>[,extra]}``."""
    matchers = ",".join(m for m in (cfg.job_selector, extra) if m)
    return f"{metric}{{{matchers}}}"


def grad_norm_by_step(cfg: MixinConfig) -> str:
    """Finite post-reduce norms labelled with the step they belong to.

    ``count_values`` turns each rank's ``ddpmon_step`` value into a ``step`` label so ranks are
    only compared at the same step. Only aggregates of it are recorded: a ``step`` label on a
    stored series would create a new series every step.
    """
    return (
        f"(({sel(cfg, 'ddpmon_grad_norm')} < +Inf)"
        f" * on (job, instance) group_left (step)"
        f' count_values without () ("step", {sel(cfg, "ddpmon_step")}))'
    )


def recording_rules(cfg: MixinConfig) -> list[dict]:
    """Rule groups in Prometheus' rule file shape."""
    w = cfg.rate_window

    def rate_sum(metric: str, by: str = "run, rank") -> str:
        return f"sum by ({by}) (rate({sel(cfg, metric)}[{w}]))"

    def quantile(q: str, metric: str, by: str) -> str:
        return f"histogram_quantile({q}, {rate_sum(metric + '_bucket', by + ', le')}) >= 0"

    def p99(metric: str, by: str) -> str:
        return quantile("0.99", metric, by)

    by_step = grad_norm_by_step(cfg)
    step_rules: list[dict] = [
        {
            "record": STEP_MEAN,
            "expr": f"{rate_sum('ddpmon_step_duration_seconds_sum')}\n"
            f"/\n{rate_sum('ddpmon_step_duration_seconds_count')}",
        },
        {"record": STEP_P99, "expr": p99("ddpmon_step_duration_seconds", "run, rank")},
        *(
            {
                "record": STEP_RUN_QUANTILE,
                "expr": f"quantile by (run) ({q}, {STEP_MEAN})",
                "labels": {"quantile": q},
            }
            for q in RUN_QUANTILES
        ),
        {"record": STEPS_RATE, "expr": rate_sum("ddpmon_steps_total")},
        {
            "record": DATA_WAIT_MEAN,
            "expr": f"{rate_sum('ddpmon_data_wait_seconds_sum')}\n"
            f"/\n{rate_sum('ddpmon_data_wait_seconds_count')}",
        },
        {
            "record": ALLREDUCE_PER_STEP,
            "expr": f"{rate_sum('ddpmon_allreduce_duration_seconds_sum')}\n"
            f"/\n{rate_sum('ddpmon_steps_total')}",
        },
        {
            # The overview's per-rank p50 heatmap: histogram_quantile over raw buckets of 1024
            # ranks is too slow for a dashboard, a recorded series per rank is not.
            "record": ALLREDUCE_P50,
            "expr": quantile("0.5", "ddpmon_allreduce_duration_seconds", "run, rank"),
        },
        {"record": ALLREDUCE_P99, "expr": p99("ddpmon_allreduce_duration_seconds", "run, rank")},
        {"record": ALLREDUCE_RUN_P99, "expr": p99("ddpmon_allreduce_duration_seconds", "run")},
        {
            # Step time minus the time spent in all-reduce: the fast ranks of a DDP run wait
            # for the slow one inside the all-reduce, so wall step time alone cannot tell them
            # apart. Runs without all-reduce (one process) count it as zero.
            "record": COMPUTE_MEAN,
            "expr": f"clamp_min(\n  {STEP_MEAN}\n  - ({ALLREDUCE_PER_STEP} or {STEP_MEAN} * 0),\n"
            "  0\n)",
        },
        {"record": COMPUTE_RUN_MEDIAN, "expr": f"quantile by (run) (0.5, {COMPUTE_MEAN})"},
    ]
    numerics_rules: list[dict] = [
        {
            "record": SKIPPED_RATIO,
            "expr": f"{rate_sum('ddpmon_amp_skipped_steps_total')}\n"
            f"/\n{rate_sum('ddpmon_steps_total')}",
        },
        {
            "record": GRAD_NORM_RUN_MAX,
            "expr": f"max by (run) ({sel(cfg, 'ddpmon_grad_norm')} < +Inf)",
        },
        {
            "record": GRAD_NORM_RUN_SPREAD,
            "expr": "max by (run) (\n"
            f"  (max by (run, step) ({by_step}) - min by (run, step) ({by_step}))\n"
            f"  / max by (run, step) ({by_step})\n"
            f"  and on (run, step) (count by (run, step) ({by_step}) > 1)\n"
            ")",
        },
    ]
    liveness_rules: list[dict] = [
        {"record": RANKS_REPORTING, "expr": f"count by (run) ({sel(cfg, 'ddpmon_world_size')})"},
        {"record": WORLD_SIZE, "expr": f"max by (run) ({sel(cfg, 'ddpmon_world_size')})"},
        {
            "record": GPU_MEMORY_RATIO,
            "expr": f"{sel(cfg, 'ddpmon_gpu_memory_used_bytes')}\n"
            f"/\n{sel(cfg, 'ddpmon_gpu_memory_total_bytes')}",
        },
    ]
    return [
        {"name": "ddpmon-numerics.rules", "rules": numerics_rules},
        {"name": "ddpmon-memory.rules", "rules": liveness_rules[2:]},
        {"name": "ddpmon-communication.rules", "rules": step_rules + liveness_rules[:2]},
    ]
