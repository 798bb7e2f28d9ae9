"""The straggler rules as they were before the chained records (issue 48's first 16,384-rank
figures), kept so that ``straggler_scale.py --compare-before`` times them beside the shipped ones
in the same store, on the same data, under the same load: the ratio is what holds on a shared
machine. Their records are written under ``rank:before_...`` names so both sets live in one
store. Also: the records in evaluation levels (a record after every record it reads), for a
backfill that sees only what earlier passes stored.
"""

from __future__ import annotations

import re

from ddpmon import metrics as m
from ddpmon.mixin import names as n
from ddpmon.mixin.config import MixinConfig

PREFIX = "rank:before_"
OWN, BY_CAUSE = (PREFIX + x.split(":", 1)[1] for x in (n.OWN_MEAN, n.OWN_BY_CAUSE))
SLOWDOWN, CAUSE = (PREFIX + x.split(":", 1)[1] for x in (n.STRAGGLER_SLOWDOWN, n.STRAGGLER_CAUSE))


def _rate(cfg: MixinConfig, metric: str, extra: str = "") -> str:
    matchers = ",".join(x for x in (cfg.job_selector, extra) if x)
    return f"rate({metric}{{{matchers}}}[{cfg.straggler_window}])"


def _part(cfg: MixinConfig, part: str = "") -> str:
    extra = f'part="{part}"' if part else ""
    return f"sum without (part) ({_rate(cfg, m.STEP_PART_SECONDS.name, extra)})"


def _reference(series: str, labels: str) -> str:
    return (f"(quantile by ({labels}) (0.5, {series}) and on ({labels}) count by ({labels}) "
            f"({series}) > 2 or min by ({labels}) ({series}))")


def records(cfg: MixinConfig) -> list[dict]:
    """The four records of before: own time and per-cause time from the raw series (the causes
    an ``or`` of four ``label_replace`` branches, each reading its raw series), slowdown and
    cause each reading its record four times (the median, the count, the minimum)."""
    step, data = m.STEP_DURATION.name, m.DATA_WAIT.name
    steps = _rate(cfg, step + "_count")
    run = ", ".join(cfg.run_labels)
    own = (f"clamp_min(({_rate(cfg, step + '_sum')} + {_rate(cfg, data + '_sum')}"
           f" - {_part(cfg, 'wait')}) / {steps}, 0)")
    causes = {
        "data": f"{_rate(cfg, data + '_sum')} / {_rate(cfg, data + '_count')}",
        "compute": f"{_part(cfg, 'compute')} / {steps}",
        "host": f"clamp_min(({_rate(cfg, step + '_sum')} - {_part(cfg)}) / {steps}, 0)",
        "communication": f"{_part(cfg, 'communication')} / {steps}",
    }
    by_cause = " or ".join(f'label_replace({e}, "cause", "{c}", "", "")' for c, e in causes.items())
    return [
        {"record": OWN, "expr": own},
        {"record": BY_CAUSE, "expr": by_cause},
        {"record": SLOWDOWN,
         "expr": f"{OWN} / on ({run}) group_left () {_reference(OWN, run)} - 1"},
        {"record": CAUSE, "expr": f"topk without (cause) (1, {BY_CAUSE} - on ({run}, cause) "
                                  f"group_left () {_reference(BY_CAUSE, run + ', cause')})"},
    ]


def queries(cfg: MixinConfig) -> dict[str, str]:
    """The rank-health problem and the alert's expression of before, reading its records."""
    run = ", ".join(cfg.run_labels)
    excess = f"{OWN} - on ({run}) group_left () {_reference(OWN, run)}"
    slowdown = f"{OWN} / on ({run}) group_left () {_reference(OWN, run)} - 1"
    return {
        "straggler problem (rank-health table)": f"({slowdown}) > {cfg.straggler_slowdown:g}",
        "DdpmonStraggler expr": (
            f"({SLOWDOWN} > {cfg.straggler_slowdown:g} and on (job, instance) ({excess}) > "
            f"{cfg.straggler_min_seconds:g}) * on (job, instance) group_left (cause) "
            f"({CAUSE} * 0 + 1)"),
    }


def reads(expr: str, name: str) -> bool:
    """Whether ``expr`` reads the series ``name`` (a whole name, not a prefix of a longer one)."""
    return re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", expr) is not None


def levels(recs: list[dict]) -> list[list[dict]]:
    """``recs`` in evaluation levels: each rule after every rule before it that writes what it
    reads (a rule reading its own name, like the per-cause ``host`` rule, reads the rules
    before it of that name)."""
    level_of: list[int] = []
    for i, rule in enumerate(recs):
        inputs = [level_of[j] for j in range(i) if reads(rule["expr"], recs[j]["record"])]
        level_of.append(1 + max(inputs, default=-1))
    return [[r for r, lv in zip(recs, level_of, strict=True) if lv == k]
            for k in range(max(level_of, default=-1) + 1)]


def combined(recs: list[dict]) -> dict[str, str]:
    """Each record name as one expression over what it reads: the rules of one name joined
    with ``or`` (their ``labels`` set by ``label_replace``), a rule's read of its own name being
    the rules before it."""
    out: dict[str, str] = {}
    for rule in recs:
        name, expr = rule["record"], rule["expr"]
        if name in out:
            earlier = f"({out[name]})"
            expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^}}]*\}})?",
                          lambda _, e=earlier: e, expr)
        for key, value in rule.get("labels", {}).items():
            expr = f'label_replace({expr}, "{key}", "{value}", "", "")'
        out[name] = f"({out[name]}) or ({expr})" if name in out else expr
    return out
