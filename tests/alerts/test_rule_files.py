"""The committed rule files are exactly what the mixin generates, and follow the alert contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddpmon.cli import main
from ddpmon.mixin import render
from ddpmon.mixin.alerts import alerts
from ddpmon.mixin.config import MixinConfig
from tests.support import alert_contract
from tests.support.contract import CONTRACT_ALERTS, PROM_DIR, REPO


def _committed_alert_rules() -> list[dict]:
    doc = yaml.safe_load((PROM_DIR / render.ALERTS_FILE).read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_committed_files_match_generator(tmp_path: Path) -> None:
    assert render.check(PROM_DIR) == [], "run `ddpmon rules --write` and commit the result"
    render.write(tmp_path)
    for name in (render.ALERTS_FILE, render.RULES_FILE):
        assert (tmp_path / name).read_text() == (PROM_DIR / name).read_text()


def test_rules_check_command_detects_drift(tmp_path: Path, capsys) -> None:
    assert main(["rules", "--write", "--dir", str(tmp_path)]) == 0
    assert main(["rules", "--check", "--dir", str(tmp_path)]) == 0
    path = tmp_path / render.ALERTS_FILE
    path.write_text(path.read_text().replace("for: 1m", "for: 3m", 1))
    assert main(["rules", "--check", "--dir", str(tmp_path)]) == 1
    assert "+    for: 1m" in capsys.readouterr().out


def test_every_design_alert_present_with_contract_fields() -> None:
    """The contract list, each alert's fields, its runbook section, its promtool cases and its
    row in docs/alerts.md (tests/support/alert_contract.py)."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted((PROM_DIR / "tests").glob("*.yml"))]
    found = alert_contract.problems(
        _committed_alert_rules(), CONTRACT_ALERTS, (PROM_DIR / "runbook.md").read_text(), docs,
        (REPO / "docs" / "alerts.md").read_text(encoding="utf-8"),
        (REPO / "docs" / "scale-out.md").read_text(encoding="utf-8"),
    )
    assert found == []


def test_config_tunes_the_output() -> None:
    cfg = MixinConfig(
        job_selector='job="train"', stall_seconds=42.0, rank_down_for="7m",
        runbook_base_url="https://example.test/rb",
    )
    text = render.generate(cfg)[render.ALERTS_FILE]
    assert 'job="ddpmon"' not in text and 'up{job="train"} == 0' in text
    assert "for: 7m" in text
    # The fallback for agents that export no ddpmon_stall_threshold_seconds.
    assert "* 0 + 42\n" in render.generate(cfg)[render.RULES_FILE]
    assert "https://example.test/rb#ddpmonrankdown" in text
    assert [a.name for a in alerts(cfg)] == [a.name for a in alerts(MixinConfig())]


def test_config_rejects_bad_durations() -> None:
    with pytest.raises(ValueError, match="stall_for"):
        MixinConfig(stall_for="five minutes")
