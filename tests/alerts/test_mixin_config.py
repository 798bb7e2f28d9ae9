"""``--config mixin.yaml``: a user's overrides reach the rules and dashboards, and rules for a
Prometheus Operator job name still pass the shipped promtool unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ddpmon.cli import main
from ddpmon.mixin.config import MixinConfig, load_config
from tests.support.contract import PROM_DIR

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
OPERATOR_JOB = "monitoring/ddpmon-ranks"


def _relabel_tests(src: Path, dest: Path, job: str) -> list[Path]:
    """The shipped promtool tests with every series and expected label moved to ``job``."""
    dest.mkdir(parents=True)
    out = []
    for path in sorted(src.glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for series in case.get("input_series", []):
                series["series"] = series["series"].replace('job="ddpmon"', f'job="{job}"')
            for check in case.get("alert_rule_test", []):
                for alert in check.get("exp_alerts") or []:
                    if alert["exp_labels"].get("job") == "ddpmon":
                        alert["exp_labels"]["job"] = job
            for check in case.get("promql_expr_test", []):
                for sample in check.get("exp_samples") or []:
                    sample["labels"] = sample["labels"].replace('job="ddpmon"', f'job="{job}"')
        (dest / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(dest / path.name)
    return out


def _promtool_test(tests: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, "test", "rules", *map(str, tests)], capture_output=True, text=True,
        timeout=120, cwd=tests[0].parent,
    )


def test_operator_job_selector_passes_the_promtool_tests(tmp_path: Path) -> None:
    config = tmp_path / "mixin.yaml"
    config.write_text(yaml.safe_dump({"job_selector": f'job="{OPERATOR_JOB}"'}))
    rules = tmp_path / "rules"
    assert main(["rules", "--write", "--dir", str(rules), "--config", str(config)]) == 0
    text = (rules / "ddpmon-alerts.yml").read_text()
    assert f'up{{job="{OPERATOR_JOB}"}}' in text and 'job="ddpmon"' not in text
    check = subprocess.run(
        [PROMTOOL, "check", "rules", *map(str, sorted(rules.glob("*.yml")))],
        capture_output=True, text=True, timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # The selector moves everywhere and nothing else changes: each file is the shipped one with
    # the default selector replaced. A hard-coded job="ddpmon" anywhere breaks the equality, and
    # since the rest is the same text, test_promtool's full run of the shipped tests holds for
    # these rules too (running all of them again here cost 17 CPU-seconds for no new outcome).
    for shipped in sorted(PROM_DIR.glob("ddpmon-*.yml")):
        moved_text = shipped.read_text().replace('job="ddpmon"', f'job="{OPERATOR_JOB}"')
        assert (rules / shipped.name).read_text() == moved_text, shipped.name
    # Live witness on one file: the relabelled tests pass against the customised rules, and the
    # default job's series do not satisfy them (the agent file's alerts stay silent).
    moved = _relabel_tests(PROM_DIR / "tests", rules / "tests", OPERATOR_JOB)
    result = _promtool_test([p for p in moved if p.name == "agent.yml"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    unmoved = _relabel_tests(PROM_DIR / "tests", rules / "unmoved", "ddpmon")
    control = _promtool_test([p for p in unmoved if p.name == "agent.yml"])
    assert control.returncode != 0 and "alertname: DdpmonAgentUnhealthy" in control.stderr, (
        control.stdout[-2000:] + control.stderr[-2000:]
    )


def test_config_fields_reach_rules_and_dashboards(tmp_path: Path) -> None:
    config = tmp_path / "mixin.yaml"
    config.write_text(yaml.safe_dump({
        "job_selector": 'job="train"',
        "loss_scale_floor_for": "7m",
        "stall_seconds": 900,
        "straggler_slowdown": 0.25,
        "dashboard_selector": 'cluster="eu-1"',
        "dashboard_datasource": "Prometheus EU",
    }))
    rules = tmp_path / "rules"
    assert main(["rules", "--write", "--dir", str(rules), "--config", str(config)]) == 0
    groups = yaml.safe_load((rules / "ddpmon-alerts.yml").read_text())["groups"]
    by_name = {r["alert"]: r for g in groups for r in g["rules"]}
    assert by_name["DdpmonLossScaleAtFloor"]["for"] == "7m"
    # The stall threshold is the fallback for agents that export none.
    assert "* 0 + 900\n" in (rules / "ddpmon-rules.yml").read_text()
    assert "rank:ddpmon_straggler:slowdown > 0.25\n" in by_name["DdpmonStraggler"]["expr"]
    root = tmp_path / "out"
    assert main(["dashboards", "--write", "--dir", str(root), "--config", str(config)]) == 0
    board = json.loads((root / "dashboards" / "ddpmon-run-overview.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs and all('cluster="eu-1"' in e for e in exprs if "ddpmon_" in e), exprs
    (ds,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert ds["current"]["value"] == "Prometheus EU"
    # In a checkout, --check still compares against the committed (default) copies.
    assert main(["dashboards", "--check"]) == 0
    assert main(["dashboards", "--check", "--config", str(config)]) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("stall_secs: 5\n", "unknown field"),
        ("stall_seconds: soon\n", "stall_seconds='soon': expected float"),
        ("stall_for: five minutes\n", "stall_for"),
        ("- a list\n", "expected a mapping"),
        ("job_selector: '{job=\"x\"}'\n", "without braces"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, content: str, message: str, capsys) -> None:
    config = tmp_path / "mixin.yaml"
    config.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(config)
    with pytest.raises(SystemExit) as exit_info:
        main(["rules", "--check", "--config", str(config)])
    assert exit_info.value.code == 2
    assert str(config) in capsys.readouterr().err


def test_integers_are_accepted_for_float_fields(tmp_path: Path) -> None:
    config = tmp_path / "mixin.yaml"
    config.write_text("straggler_slowdown: 1\n")
    assert load_config(config) == MixinConfig(straggler_slowdown=1.0)
