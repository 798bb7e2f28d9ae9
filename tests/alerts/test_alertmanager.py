"""The shipped Alertmanager config: routing (``amtool config routes test``) and, in a real
Alertmanager, one notification per incident: grouping by run and the inhibition rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from ddpmon.mixin import render, shipped
from tests.support.contract import CONTRACT_ALERTS
from tests.support.stack import Alertmanager, WebhookReceiver, wait_for

AMTOOL = shutil.which("amtool") or "/usr/bin/amtool"
CONFIG = shipped.path(shipped.ALERTMANAGER_YML)


def _route(labels: dict[str, str], receiver: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [AMTOOL, "config", "routes", "test", f"--config.file={CONFIG}",
         f"--verify.receivers={receiver}", *(f"{k}={v}" for k, v in labels.items())],
        capture_output=True, text=True, timeout=30,
    )


def test_every_alert_routes_by_severity() -> None:
    groups = yaml.safe_load(render.generate()[render.ALERTS_FILE])["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules} == set(CONTRACT_ALERTS)
    for rule in rules:
        severity = rule["labels"]["severity"]
        labels = {"alertname": rule["alert"], "severity": severity, "run": "r1"}
        proc = _route(labels, f"ddpmon-{severity}")
        assert proc.returncode == 0, (rule["alert"], proc.stdout, proc.stderr)
    assert _route({"alertname": "DdpmonFoo", "severity": "info"}, "ddpmon-null").returncode == 0
    # Control: amtool really verifies (a wrong receiver fails).
    wrong = _route({"alertname": "DdpmonRankDown", "severity": "critical"}, "ddpmon-warning")
    assert wrong.returncode != 0


def test_critical_alerts_of_a_run_form_one_group() -> None:
    route = yaml.safe_load(CONFIG.read_text())["route"]
    (critical,) = [r for r in route["routes"] if r["matchers"] == ['severity="critical"']]
    assert "run" in critical["group_by"] and "alertname" not in critical["group_by"]
    assert {"run", "alertname"} <= set(route["group_by"])


def _post(am: Alertmanager, alerts: list[dict[str, str]]) -> None:
    now = datetime.now(UTC)
    body = [
        {
            "labels": labels,
            "annotations": {"summary": "test."},
            "startsAt": now.isoformat(),
            "endsAt": (now + timedelta(hours=1)).isoformat(),
        }
        for labels in alerts
    ]
    req = urllib.request.Request(
        f"{am.url}/api/v2/alerts", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def _a(name: str, severity: str, run: str, rank: str | None = None) -> dict[str, str]:
    labels = {"alertname": name, "severity": severity, "run": run, "job": "ddpmon"}
    if rank is not None:
        labels["rank"] = rank
    return labels


@pytest.mark.timeout(120)
def test_one_page_per_incident_in_a_real_alertmanager(tmp_path: Path) -> None:
    """What the shipped rules fire for each incident (their promtool tests show it) goes into a
    real Alertmanager with the shipped config; only the cause is notified."""
    incidents = [
        # r1: rank 1 killed: its peers stall, fall behind and wait in the all-reduce.
        _a("DdpmonRankDown", "critical", "r1", "1"),
        _a("DdpmonRanksMissing", "critical", "r1"),
        _a("DdpmonTrainingStalled", "critical", "r1"),
        _a("DdpmonRankDesync", "warning", "r1", "0"),
        _a("DdpmonStraggler", "warning", "r1", "0"),
        _a("DdpmonCollectiveSlow", "warning", "r1"),
        # r2: a stall with no dead rank pages.
        _a("DdpmonTrainingStalled", "critical", "r2"),
        # r3: a data-starved rank; the healthy ranks' slow all-reduce is its symptom.
        _a("DdpmonDataStarved", "warning", "r3", "3"),
        _a("DdpmonCollectiveSlow", "warning", "r3"),
        # r4: persistent overflows: the floor pages, not the non-finite gradients.
        _a("DdpmonLossScaleAtFloor", "critical", "r4", "1"),
        _a("DdpmonLossScaleCollapsing", "warning", "r4", "1"),
        _a("DdpmonNonFiniteGradients", "critical", "r4"),
        # r5: non-finite gradients of another run are not inhibited by r4's floor.
        _a("DdpmonNonFiniteGradients", "critical", "r5"),
    ]
    with (
        WebhookReceiver() as hook,
        Alertmanager(
            # A short group_wait (shipped: 10s/30s) lets the inhibitor see the alerts that
            # arrived together before the group is flushed, as it would in production.
            tmp_path / "am", webhook_url=hook.url, group_wait="2s", group_interval="1s",
            repeat_interval="1h",
        ) as am,
    ):
        _post(am, incidents)
        expected_runs = {"r1", "r2", "r3", "r4", "r5"}
        wait_for(
            lambda: {n["groupLabels"].get("run") for n in hook.notifications} >= expected_runs,
            30, what="a notification for every run",
        )
        time.sleep(3)  # three group intervals: anything else would have arrived
        with urllib.request.urlopen(f"{am.url}/api/v2/alerts", timeout=10) as resp:
            held = json.load(resp)

    sent = {}
    for n in hook.notifications:
        key = (n["path"], n["groupLabels"].get("run"))
        sent.setdefault(key, []).append(sorted(a["labels"]["alertname"] for a in n["alerts"]))
    assert sent == {
        ("ddpmon-critical", "r1"): [["DdpmonRankDown"]],
        ("ddpmon-critical", "r2"): [["DdpmonTrainingStalled"]],
        ("ddpmon-warning", "r3"): [["DdpmonDataStarved"]],
        ("ddpmon-critical", "r4"): [["DdpmonLossScaleAtFloor"]],
        ("ddpmon-critical", "r5"): [["DdpmonNonFiniteGradients"]],
    }, sent
    inhibited = {
        (a["labels"]["alertname"], a["labels"]["run"])
        for a in held
        if a["status"]["inhibitedBy"]
    }
    assert inhibited == {
        ("DdpmonRanksMissing", "r1"), ("DdpmonTrainingStalled", "r1"),
        ("DdpmonRankDesync", "r1"), ("DdpmonStraggler", "r1"), ("DdpmonCollectiveSlow", "r1"),
        ("DdpmonCollectiveSlow", "r3"),
        ("DdpmonLossScaleCollapsing", "r4"), ("DdpmonNonFiniteGradients", "r4"),
    }
