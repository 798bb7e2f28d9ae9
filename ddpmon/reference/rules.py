"""Reference pages built from the generated rule files: alerts (with each runbook entry) and
recording rules. Read from the shipped copies, so the pages describe exactly what users load."""

from __future__ import annotations

import re

import yaml

from ..mixin import shipped
from .markdown import code, header, table

ALERTS = f"{shipped.PROMETHEUS_DIR}/ddpmon-alerts.yml"
RULES = f"{shipped.PROMETHEUS_DIR}/ddpmon-rules.yml"
RUNBOOK = f"{shipped.PROMETHEUS_DIR}/runbook.md"


def _groups(rel: str) -> list[dict]:
    return yaml.safe_load(shipped.path(rel).read_text(encoding="utf-8"))["groups"]


def runbook_sections() -> dict[str, str]:
    """Alert name -> its runbook section's body (the text under ``### <Alert>``)."""
    text = shipped.path(RUNBOOK).read_text(encoding="utf-8")
    sections: dict[str, str] = {}
    for m in re.finditer(r"^### (\w+)\n(.*?)(?=^##)", text + "\n##", flags=re.M | re.S):
        sections[m.group(1)] = m.group(2).strip()
    return sections


def runbook_general() -> list[str]:
    """The runbook's ``##`` sections that hold no alert (what to collect in a hang, ...)."""
    text = shipped.path(RUNBOOK).read_text(encoding="utf-8")
    blocks = re.split(r"^(?=## )", text, flags=re.M)[1:]
    return [b.strip() for b in blocks if "\n### " not in b]


def _fence(expr: str) -> str:
    return f"```promql\n{expr.strip()}\n```\n"


def alerts_page() -> str:
    runbook = runbook_sections()
    out = [
        header(
            "Alerts and runbook",
            f"`{ALERTS}` and `{RUNBOOK}`",
            """
Every alert of the shipped `ddpmon-alerts.yml`, by group, with its expression and its runbook
entry. Thresholds and `for:` come from `ddpmon/mixin/config.py` (override them with
`--config mixin.yaml`, see [Alerts](../alerts.md#tuning)); the expressions below are the
defaults. Each alert's `runbook_url` points at the same entry in
`deploy/prometheus/runbook.md`.
""",
        )
    ]
    out += ["\n" + block + "\n" for block in runbook_general()]
    for group in _groups(ALERTS):
        out.append(f"\n## {group['name']}\n")
        for rule in group["rules"]:
            name = rule["alert"]
            ann = rule.get("annotations", {})
            out.append(f"\n### {name}\n\n")
            out.append(
                table(
                    ("severity", "for", "summary"),
                    [(rule.get("labels", {}).get("severity", ""), rule.get("for", "0s"),
                      ann.get("summary", ""))],
                )
            )
            out.append("\n" + _fence(rule["expr"]))
            entry = runbook.get(name)
            if entry is None:
                raise ValueError(f"{RUNBOOK}: no section for alert {name}")
            body = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 1) + " ", entry, flags=re.M)
            out.append("\n" + body + "\n")
    return "".join(out)


def recording_rules_page() -> str:
    out = [
        header(
            "Recording rules",
            f"`{RULES}`",
            """
Names follow Prometheus' `level:metric:operations`. `rank:` records are per rank and keep
every target label; `run:` records aggregate `by (cluster, namespace, job, run)`. Alerts and
dashboards read these records; a test fails on a record nothing reads. Which of them can
run on a scraping shard and which need the whole run:
[Deployment](../deployment.md#past-one-prometheus).
""",
        )
    ]
    for group in _groups(RULES):
        out.append(f"\n## {group['name']}\n\n")
        rows = [(code(r["record"] + _labels(r)), code(" ".join(r["expr"].split())))
                for r in group["rules"]]
        out.append(table(("record", "expression"), rows))
    return "".join(out)


def _labels(rule: dict) -> str:
    """The labels a rule sets (several rules may record one name, each with its own)."""
    labels = rule.get("labels") or {}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
