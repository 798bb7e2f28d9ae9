"""``promtool check rules`` and ``promtool test rules`` over the shipped files (real promtool)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.contract import CONTRACT_ALERTS, PROM_DIR
from tests.support.engines import reads

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
TEST_FILES = sorted((PROM_DIR / "tests").glob("*.yml"))


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=PROM_DIR
    )


def test_check_rules_clean() -> None:
    proc = _promtool("check", "rules", "ddpmon-rules.yml", "ddpmon-alerts.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(CONTRACT_ALERTS)} rules found" in proc.stdout


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    proc = _promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_recording_rule_has_a_promql_expr_test() -> None:
    rules = yaml.safe_load((PROM_DIR / "ddpmon-rules.yml").read_text())
    records = {r["record"] for g in rules["groups"] for r in g["rules"]}
    tested: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("promql_expr_test", []):
                if check.get("exp_samples"):
                    tested |= {r for r in records if reads(check["expr"], r)}
    assert records and records <= tested, sorted(records - tested)


def test_every_recording_rule_is_used() -> None:
    """By an alert, a dashboard or another record: no dead records."""
    from ddpmon.mixin import outputs, render

    rules = yaml.safe_load(render.generate()[render.RULES_FILE])
    records = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    consumers = [render.generate()[render.ALERTS_FILE], *records.values()]
    consumers += [t for rel, t in outputs.generate().items() if rel.startswith("dashboards/")]
    unused = [r for r in records if not any(reads(text, r) for text in consumers)]
    assert unused == []


def test_unit_tests_cover_every_alert_before_and_after_for() -> None:
    """Each alert has a case where it must not fire and one where it fires with its labels;
    RankDown and RanksMissing also have a vanished (stale) series."""
    quiet: set[str] = set()
    firing: set[str] = set()
    stale: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            has_stale = any("stale" in s["values"] for s in case.get("input_series", []))
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                if check.get("exp_alerts"):
                    firing.add(name)
                    for alert in check["exp_alerts"]:
                        assert alert["exp_labels"]["severity"] == CONTRACT_ALERTS[name]
                        assert set(alert["exp_annotations"]) == {
                            "summary", "description", "runbook_url"
                        }
                else:
                    quiet.add(name)
                if has_stale:
                    stale.add(name)
    assert quiet >= set(CONTRACT_ALERTS), set(CONTRACT_ALERTS) - quiet
    assert firing >= set(CONTRACT_ALERTS), set(CONTRACT_ALERTS) - firing
    assert {"DdpmonRankDown", "DdpmonRanksMissing"} <= stale
