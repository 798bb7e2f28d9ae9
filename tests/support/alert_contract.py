"""The checks every alert must pass, as one function over the places docs/architecture.md's
alert recipe names: the rules (generated), the contract list, the runbook, the promtool cases,
docs/alerts.md's table and docs/scale-out.md's federation table (which row:
tests/scaleout/test_configs.py). The contract tests run it over the shipped files; the recipe
test over a made-up alert, before and after its recipe."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ddpmon.mixin.config import MixinConfig


def runbook_anchors(runbook: str) -> set[str]:
    """The anchors of the runbook's alert headings (``## DdpmonX`` -> ``ddpmonx``)."""
    return {h.lower() for h in re.findall(r"^#+ (Ddpmon\w+)\s*$", runbook, re.M)}


def alerts_table(alerts_md: str) -> dict[str, tuple[str, str]]:
    """docs/alerts.md's table: alert -> (severity, for)."""
    table = {}
    for line in alerts_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("Ddpmon"):
            table[cells[0]] = (cells[1], cells[2])
    return table


def federation_rows(scale_out_md: str) -> dict[str, str]:
    """docs/scale-out.md's where-each-rule-runs table: alert -> ``each shard`` or ``global``."""
    placed = {}
    for line in scale_out_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in ("each shard", "global"):
            for name in re.findall(r"Ddpmon\w+", cells[1]):
                if name in placed:
                    raise ValueError(f"{name} is in two rows of docs/scale-out.md's table")
                placed[name] = cells[0]
    return placed


def promtool_cases(test_docs: Iterable[Mapping]) -> tuple[set[str], set[str], set[str]]:
    """Alerts with a case where they must stay quiet, with one where they fire, and with one
    over a vanished (stale) series, in promtool test files (parsed YAML)."""
    quiet: set[str] = set()
    firing: set[str] = set()
    stale: set[str] = set()
    for doc in test_docs:
        for case in doc["tests"]:
            has_stale = any("stale" in s["values"] for s in case.get("input_series", []))
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                (firing if check.get("exp_alerts") else quiet).add(name)
                if has_stale:
                    stale.add(name)
    return quiet, firing, stale


def problems(
    rules: list[dict],
    contract: Mapping[str, str],
    runbook: str,
    test_docs: list[Mapping],
    alerts_md: str,
    scale_out_md: str,
    cfg: MixinConfig | None = None,
) -> list[str]:
    """Every way the alerts in ``rules`` (the alerting rules of the rule file) fall short of
    the contract; empty when they all hold."""
    cfg = cfg or MixinConfig()
    out: list[str] = []
    by_name = {rule["alert"]: rule for rule in rules}
    for name in sorted(set(by_name) ^ set(contract)):
        out.append(f"{name}: in the rules but not the contract list" if name in by_name
                   else f"{name}: in the contract list but not the rules")
    anchors = runbook_anchors(runbook)
    quiet, firing, _ = promtool_cases(test_docs)
    table = alerts_table(alerts_md)
    placed = federation_rows(scale_out_md)
    for name, rule in by_name.items():
        if name in contract and rule["labels"]["severity"] != contract[name]:
            out.append(f"{name}: severity {rule['labels']['severity']}, contract {contract[name]}")
        if not re.fullmatch(r"[0-9]+[smh]", rule.get("for", "")):
            out.append(f"{name}: for: {rule.get('for')!r} is not a duration")
        notes = rule["annotations"]
        if not notes["summary"].endswith(".") or "{{" in notes["summary"]:
            out.append(f"{name}: summary must be static and end with a period")
        if "$labels.run" not in notes["description"] or "rank" not in notes["description"]:
            out.append(f"{name}: description must name the run and the rank(s)")
        base, _, anchor = notes["runbook_url"].partition("#")
        if base != cfg.runbook_base_url or anchor not in anchors:
            out.append(f"{name}: no runbook section for #{anchor}")
        if name not in quiet:
            out.append(f"{name}: no promtool case where it stays quiet")
        if name not in firing:
            out.append(f"{name}: no promtool case where it fires")
        for_ = rule.get("for", "0m")
        if table.get(name) != (rule["labels"]["severity"], for_):
            out.append(f"{name}: docs/alerts.md's table lacks | {name} | "
                       f"{rule['labels']['severity']} | {for_} |")
        if name not in placed:
            out.append(f"{name}: not placed in docs/scale-out.md's where-each-rule-runs table")
    for name in sorted(set(table) - set(by_name)):
        out.append(f"{name}: in docs/alerts.md's table but not the rules")
    return out
