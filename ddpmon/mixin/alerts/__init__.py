"""Alert rules (docs/alerts.md), generated from a :class:`MixinConfig`, one module per layer.

Every alert has ``severity``, ``for``, a static ``summary`` ending in a period, a templated
``description`` naming the run and the rank(s), and ``runbook_url`` pointing at its heading in
``deploy/prometheus/runbook.md``. Groups follow the layers (numerics, data supply, memory,
communication), then the agent's own health.

A **cause** on one rank (a straggler, a starved rank, a dead rank, an OOM) is one alert per rank,
carrying ``run``, ``rank`` and the target labels. A **symptom of the whole run** (non-finite
reduced gradients, a stall, slow all-reduce, missing ranks, desynced replicas, duplicated data)
is one alert per run, carrying ``MixinConfig.run_labels``; its description lists the ranks,
worst first and capped at ``alert_rank_cap``. Alertmanager groups critical alerts by run and
inhibits the symptoms of a cause it already paged for (``deploy/alertmanager/alertmanager.yml``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpmon.metrics import Layer
from ddpmon.mixin.config import MixinConfig

AGENT_GROUP = "agent"
"""Group of the alerts about ddpmon itself (not a layer of training)."""


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    layer: Layer
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
RUN = "Run {{ $labels.run }}"


def rank_list(
    query: str, cfg: MixinConfig, *, worst_first: bool = True, fill: tuple[str, ...] = ()
) -> str:
    """Go template listing the ``rank`` labels of a PromQL query, comma separated, at most
    ``alert_rank_cap`` of them: the highest values first, or sorted by rank.

    Each ``%s`` in ``query`` is filled with the alert's ``run`` label, or with the alert's
    labels named in ``fill``, in turn (``run, op, run, op...``).
    """
    fill = fill or ("run",)
    names = [fill[i % len(fill)] for i in range(query.count("%s"))]
    args = "".join(f" $labels.{name}" for name in names)
    capped = f"topk({cfg.alert_rank_cap}, {query})"
    pipeline = (
        f"query (printf `sort_desc({capped})`{args})"
        if worst_first
        else f'query (printf `{capped}`{args}) | sortByLabel "rank"'
    )
    return (
        f"{{{{ range $i, $s := {pipeline} }}}}"
        "{{ if $i }}, {{ end }}{{ $s.Labels.rank }}{{ else }}none{{ end }}"
    )


def alerts(cfg: MixinConfig) -> list[Alert]:
    """All alerts, in layer order."""
    # the layer modules import Alert and RANK from this package: imported at call, not a cycle
    from ddpmon.mixin.alerts import (
        agent,
        checkpoints,
        communication,
        data,
        goodput,
        hangs,
        memory,
        numerics,
    )

    return [
        *numerics.alerts(cfg),
        *data.alerts(cfg),
        *memory.alerts(cfg),
        *communication.alerts(cfg),
        *hangs.alerts(cfg),
        *agent.alerts(cfg),
        *checkpoints.alerts(cfg),
        *goodput.alerts(cfg),
    ]


def _group(layer: Layer) -> str:
    return AGENT_GROUP if layer is Layer.IDENTITY else layer.slug


def alert_groups(cfg: MixinConfig) -> list[dict]:
    """Rule groups in Prometheus' rule file shape, one per layer (in order)."""
    all_alerts = alerts(cfg)
    layers = list(dict.fromkeys(a.layer for a in all_alerts))
    return [
        {
            "name": f"ddpmon-{_group(layer)}.alerts",
            "rules": [a.rule(cfg) for a in all_alerts if a.layer is layer],
        }
        for layer in layers
    ]
