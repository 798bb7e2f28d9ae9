"""Straggler attribution in PromQL: each rank's own time per step, its slowdown against the median
rank of its run (or of its pipeline stage; the other rank in a 2-rank group: :func:`reference_expr`)
and the cause; the records and the ``DdpmonStraggler`` alert.

Under DDP every rank's step lasts as long as the slowest rank's, so step time cannot name a
straggler: the fast ranks spend the difference waiting in the all-reduce. Each rank exports its
step's parts (``ddpmon_step_part_seconds_total``: ``compute``, ``wait`` and ``communication``, see
``ddpmon.agent.step_split``); its *own* time per step is everything but the wait:

    own = (step time + data wait - wait) per step

and the cross-rank comparison happens here, per run, so it needs no agent-to-agent traffic:
``slowdown = own / median rank's own - 1``. The cause is the part whose excess over the median
rank's is the largest: ``data`` (data wait), ``compute`` (forward, backward, optimizer),
``host`` (the rest of the step) or ``communication`` (issuing its own collectives:
``ddpmon.probes.comm_issue``).

Pipeline stages. Under pipeline parallel the parts carry the rank's ``stage`` (the strategy's
``stage_label``; absent elsewhere), and every comparison is within the run *and stage*
(:data:`STAGE`): a stage heavier by design is not a straggler, a stage's bubble is ``wait`` and
names nobody, and a slow replica is named with its stage.

Cost by construction (16,384 ranks: every rule reads at most 4 series per rank and relabels
none). The records chain, each reading what an earlier one in its group recorded instead of
recomputing it: own time from the raw series; the causes one rule each (the rule sets the
``cause`` label), ``host`` as the rest of the own time (no second read of every part); one
reference per run and stage (the median rank's own time; the median per cause); the slowdown
and the cause against those few series.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig

TARGET = "on (job, instance, run)"
"""One rank's series across records (every ``rank:`` record keeps the target labels and the
run). The run too: when a port passes to the next run (a node's next job), both runs' rates are
in the window for a minute, and a join on the target alone failed the whole rule."""
STAGE = "stage"
"""The label of a pipeline rank's stage (on its step parts); a group's label beside the run's."""
CAUSES = ("data", "compute", "communication")
"""The causes read from the raw series; ``host`` is the rest of the own time."""


def _rate(cfg: MixinConfig, metric: str, extra: str = "") -> str:
    matchers = ",".join(x for x in (cfg.job_selector, extra) if x)
    return f"rate({metric}{{{matchers}}}[{cfg.straggler_window}])"


def _part(cfg: MixinConfig, part: str = "") -> str:
    extra = f'part="{part}"' if part else ""
    return f"sum without (part) ({_rate(cfg, m.STEP_PART_SECONDS.name, extra)})"


def group(cfg: MixinConfig) -> str:
    """The labels of a comparison group: the run's and the pipeline stage (absent outside
    pipelines, where the group is the run)."""
    return ", ".join([*cfg.run_labels, STAGE])


def own_expr(cfg: MixinConfig) -> str:
    """A rank's own seconds per step: step time and data wait, less the time it waited for the
    other ranks inside collectives (its ``stage`` from the wait part)."""
    step, data = m.STEP_DURATION.name, m.DATA_WAIT.name
    steps = _rate(cfg, step + "_count")
    return (
        f"clamp_min(\n  ({_rate(cfg, step + '_sum')} + {_rate(cfg, data + '_sum')}\n"
        f"   - ignoring ({STAGE}) group_right () {_part(cfg, 'wait')})\n"
        f"  / ignoring ({STAGE}) group_left () {steps},\n  0\n)"
    )


def by_cause_expr(cfg: MixinConfig, cause: str) -> str:
    """A rank's own seconds per step in ``cause`` (data wait, compute or communication): one
    rule per cause, each reading its raw series once and labelled by the rule (no relabelling
    of every rank's series). The parts carry the rank's ``stage``; the data wait takes it
    from the rank's wait part."""
    step, data = m.STEP_DURATION.name, m.DATA_WAIT.name
    steps = _rate(cfg, step + "_count")
    if cause == "data":
        return (f"0 * {_part(cfg, 'wait')}\n+ ignoring ({STAGE}) group_left ()\n"
                f"({_rate(cfg, data + '_sum')} / {steps})")
    return f"{_part(cfg, cause)}\n/ ignoring ({STAGE}) group_left ()\n{steps}"


def host_expr() -> str:
    """The rest of a rank's own time per step (``cause="host"``): the loop's code between the
    parts, from the records before it (own time less the three causes)."""
    causes = "|".join(CAUSES)
    return (f'clamp_min(\n  {n.OWN_MEAN}\n  - {TARGET} group_left ()\n'
            f'  sum without (cause) ({n.OWN_BY_CAUSE}{{cause=~"{causes}"}}),\n  0\n)')


def reference_expr(series: str, labels: str) -> str:
    """What a rank is compared with, per ``labels`` (the run, or the run and stage): the median
    rank's value where the group has 3 ranks or more, else the smaller rank's. The median holds
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
    """Own time over its group's reference rank's (:data:`names.OWN_REFERENCE`), less one
    (0.15: 15 % slower)."""
    return f"{own}\n/ on ({group(cfg)}) group_left ()\n{n.OWN_REFERENCE}\n- 1"


def cause_expr(cfg: MixinConfig) -> str:
    """Per rank, the cause whose seconds per step exceed its group's median rank's the most
    (value: the excess in seconds per step; in a group of 2 ranks, half the gap to the other,
    the median being their mean: which cause is the largest is the same)."""
    return (
        f"topk without (cause) (1,\n  {n.OWN_BY_CAUSE}\n  - on ({group(cfg)}, cause) "
        f"group_left ()\n  {n.OWN_MEDIAN_BY_CAUSE}\n)"
    )


def records(cfg: MixinConfig) -> list[dict]:
    """The straggler records, in evaluation order (each after the records it reads)."""
    by = group(cfg)
    return [
        {"record": n.OWN_MEAN, "expr": own_expr(cfg)},
        *({"record": n.OWN_BY_CAUSE, "expr": by_cause_expr(cfg, c), "labels": {"cause": c}}
          for c in CAUSES),
        {"record": n.OWN_BY_CAUSE, "expr": host_expr(), "labels": {"cause": "host"}},
        {"record": n.OWN_REFERENCE, "expr": reference_expr(n.OWN_MEAN, by)},
        {"record": n.OWN_MEDIAN_BY_CAUSE,
         "expr": f"quantile by ({by}, cause) (0.5, {n.OWN_BY_CAUSE})"},
        {"record": n.STRAGGLER_SLOWDOWN, "expr": slowdown_expr(cfg)},
        {"record": n.STRAGGLER_CAUSE, "expr": cause_expr(cfg)},
    ]


def problem_expr(cfg: MixinConfig) -> str:
    """The rank-health table's ``straggler`` problem (the rank's own time and its group's
    reference, both recorded)."""
    return f"({slowdown_expr(cfg)}) > {cfg.straggler_slowdown:g}"


def alert(cfg: MixinConfig):
    """``DdpmonStraggler``: one alert per slow rank, with its ``cause`` (and its ``stage`` under
    pipeline parallel)."""
    # mixin.alerts imports this module for the alert list: imported at call, not a cycle
    from ddpmon.mixin.alerts import RANK, Alert

    excess = f"{n.OWN_MEAN} - on ({group(cfg)}) group_left () {n.OWN_REFERENCE}"
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
        f"{RANK}{{{{ with $labels.stage }}}} (pipeline stage {{{{ . }}}}){{{{ end }}}} takes "
        "{{ $value | humanizePercentage }} longer per step than the {{ if $labels.stage }}"
        "median rank of its stage{{ else }}run's median rank{{ end }}, doing its own work "
        "(the others wait for it inside collectives); cause: "
        f"{{{{ $labels.cause }}}}. Slow for at least {cfg.straggler_for} (since step {since} "
        "or earlier).",
    )
