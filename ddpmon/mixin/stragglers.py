"""Straggler attribution in PromQL: each rank's own time per step, its slowdown against the run's
median rank (the other rank in a 2-rank run: :func:`reference_expr`) and the cause; the records
and the ``DdpmonStraggler`` alert.

Under DDP every rank's step lasts as long as the slowest rank's, so step time cannot name a
straggler: the fast ranks spend the difference waiting in the all-reduce. Each rank exports its
step's parts (``ddpmon_step_part_seconds_total``: ``compute``, ``wait`` and ``communication``, see
``ddpmon.agent.step_split``); its *own* time per step is everything but the wait:

    own = (step time + data wait - wait) per step

and the cross-rank comparison happens here, per run, so it needs no agent-to-agent traffic:
``slowdown = own / median rank's own - 1``. The cause is the part whose excess over the median
rank's is the largest: ``data`` (data wait), ``compute`` (forward, backward, optimizer),
``host`` (the rest of the step) or ``communication`` (issuing its own collectives:
``ddpmon.probes.comm_issue``). Series: two records per rank (own time, slowdown), four by
cause, one cause per rank; every expression reads raw series or first-order records only.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig

TARGET = "on (job, instance)"
"""One rank's series across records (every ``rank:`` record keeps the target labels)."""


def _rate(cfg: MixinConfig, metric: str, extra: str = "") -> str:
    matchers = ",".join(x for x in (cfg.job_selector, extra) if x)
    return f"rate({metric}{{{matchers}}}[{cfg.straggler_window}])"


def _part(cfg: MixinConfig, part: str = "") -> str:
    extra = f'part="{part}"' if part else ""
    return f"sum without (part) ({_rate(cfg, m.STEP_PART_SECONDS.name, extra)})"


def own_expr(cfg: MixinConfig) -> str:
    """A rank's own seconds per step: step time and data wait, less the time it waited for the
    other ranks inside collectives."""
    step, data = m.STEP_DURATION.name, m.DATA_WAIT.name
    steps = _rate(cfg, step + "_count")
    return (
        f"clamp_min(\n  ({_rate(cfg, step + '_sum')} + {_rate(cfg, data + '_sum')}"
        f" - {_part(cfg, 'wait')})\n  / {steps},\n  0\n)"
    )


def by_cause_expr(cfg: MixinConfig) -> str:
    """A rank's own seconds per step by cause (``cause`` label: data, compute, host,
    communication)."""
    step, data = m.STEP_DURATION.name, m.DATA_WAIT.name
    steps = _rate(cfg, step + "_count")
    causes = {
        "data": f"{_rate(cfg, data + '_sum')} / {_rate(cfg, data + '_count')}",
        "compute": f"{_part(cfg, 'compute')} / {steps}",
        "host": f"clamp_min(({_rate(cfg, step + '_sum')} - {_part(cfg)}) / {steps}, 0)",
        "communication": f"{_part(cfg, 'communication')} / {steps}",
    }
    return "\nor\n".join(
        f'label_replace({expr}, "cause", "{cause}", "", "")' for cause, expr in causes.items()
    )


def reference_expr(series: str, labels: str) -> str:
    """What a rank is compared with, per ``labels`` (the run, or the run and cause): the median
    rank's value where the run has 3 ranks or more, else the smaller rank's. The median holds
    the rank compared too; with one straggler among 3 or more ranks it is another rank's value,
    but with 2 ranks it is their mean, which would halve the straggler's slowdown: there the
    slower rank is compared with the other one (the minimum; the faster rank reads 0).
    A median of the *other* ranks per rank is not expressible in PromQL without a join per
    rank (16,384 ranks)."""
    return (
        f"(\n  quantile by ({labels}) (0.5, {series})\n"
        f"  and on ({labels}) count by ({labels}) ({series}) > 2\n"
        f"  or\n  min by ({labels}) ({series})\n)"
    )


def slowdown_expr(cfg: MixinConfig, own: str = n.OWN_MEAN) -> str:
    """Own time over the run's reference rank's (:func:`reference_expr`), less one (0.15: 15 %
    slower)."""
    run = ", ".join(cfg.run_labels)
    return f"{own}\n/ {cfg.on_run} group_left ()\n{reference_expr(own, run)}\n- 1"


def cause_expr(cfg: MixinConfig) -> str:
    """Per rank, the cause whose seconds per step exceed the run median rank's the most (value:
    the excess in seconds per step)."""
    run = ", ".join(cfg.run_labels)
    return (
        f"topk without (cause) (1,\n  {n.OWN_BY_CAUSE}\n  - on ({run}, cause) group_left ()\n"
        f"  {reference_expr(n.OWN_BY_CAUSE, run + ', cause')}\n)"
    )


def records(cfg: MixinConfig) -> list[dict]:
    """The straggler records, in evaluation order (first-order before those reading them)."""
    return [
        {"record": n.OWN_MEAN, "expr": own_expr(cfg)},
        {"record": n.OWN_BY_CAUSE, "expr": by_cause_expr(cfg)},
        {"record": n.STRAGGLER_SLOWDOWN, "expr": slowdown_expr(cfg)},
        {"record": n.STRAGGLER_CAUSE, "expr": cause_expr(cfg)},
    ]


def problem_expr(cfg: MixinConfig) -> str:
    """The rank-health table's ``straggler`` problem (first-order records only)."""
    return f"({slowdown_expr(cfg)}) > {cfg.straggler_slowdown:g}"


def alert(cfg: MixinConfig):
    """``DdpmonStraggler``: one alert per slow rank, with its ``cause``."""
    # mixin.alerts imports this module for the alert list: imported at call, not a cycle
    from ddpmon.mixin.alerts import RANK, Alert

    run = ", ".join(cfg.run_labels)
    excess = f"{n.OWN_MEAN} - {cfg.on_run} group_left ()\n{reference_expr(n.OWN_MEAN, run)}"
    since = (
        f'{{{{ with printf `{m.STEP.name}{{job="%s",instance="%s"}} offset '
        f'{cfg.straggler_for}` $labels.job $labels.instance | query }}}}'
        '{{ . | first | value | printf "%.0f" }}{{ else }}its first scraped step{{ end }}'
    )
    return Alert(
        "DdpmonStraggler", Layer.COMMUNICATION, "warning",
        f"(\n  {n.STRAGGLER_SLOWDOWN} > {cfg.straggler_slowdown:g}\n"
        f"  and {TARGET}\n  ({excess}) > {cfg.straggler_min_seconds:g}\n)\n"
        f"* {TARGET} group_left (cause)\n({n.STRAGGLER_CAUSE} * 0 + 1)",
        cfg.straggler_for,
        "A rank is slower than the others and holds the run back.",
        f"{RANK} takes {{{{ $value | humanizePercentage }}}} longer per step than the run's "
        "median rank, doing its own work (the others wait for it inside collectives); cause: "
        f"{{{{ $labels.cause }}}}. Slow for at least {cfg.straggler_for} (since step {since} "
        "or earlier).",
    )
