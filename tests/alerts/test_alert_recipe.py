"""docs/architecture.md's alert recipe, held: a made-up alert added to a layer's module reaches
the generated rules, and the contract checks (tests/support/alert_contract.py, which the shipped
alerts pass) want exactly the places the recipe names until they are done; done, they pass and a
real promtool runs its cases."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from ddpmon.metrics import Layer
from ddpmon.mixin import render
from ddpmon.mixin.alerts import RUN, Alert, numerics
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel
from tests.support import alert_contract
from tests.support.contract import CONTRACT_ALERTS, PROM_DIR, REPO

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NAME = "DdpmonLossAboveAMillion"


def loss_above_a_million(cfg: MixinConfig) -> Alert:
    return Alert(
        NAME, Layer.NUMERICS, "warning",
        f"max by (run, rank) ({sel(cfg, 'ddpmon_loss')}) > 1e6", "5m",
        "A rank's loss is above a million.",
        f"{RUN}: rank {{{{ $labels.rank }}}} reports a loss of {{{{ $value }}}}.",
    )


CASES = f"""
rule_files: [../ddpmon-rules.yml, ../ddpmon-alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'ddpmon_loss{{job="ddpmon",instance="h:7470",run="r1",rank="0"}}'
        values: '2x3 2e7x20'
    alert_rule_test:
      - eval_time: 6m
        alertname: {NAME}
        exp_alerts: []
      - eval_time: 10m
        alertname: {NAME}
        exp_alerts:
          - exp_labels: {{severity: warning, run: r1, rank: "0"}}
            exp_annotations:
              summary: A rank's loss is above a million.
              description: 'Run r1: rank 0 reports a loss of 2e+07.'
              runbook_url: {MixinConfig().runbook_base_url}#{NAME.lower()}
"""


def _alerting_rules(text: str) -> list[dict]:
    return [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def test_an_alert_added_by_the_recipe_is_wanted_at_each_place_it_names(monkeypatch, tmp_path):
    shipped = numerics.alerts
    monkeypatch.setattr(numerics, "alerts", lambda c: [*shipped(c), loss_above_a_million(c)])
    # step 1: the layer's module -> the generated rules, in its layer's group
    generated = render.generate()
    groups = yaml.safe_load(generated[render.ALERTS_FILE])["groups"]
    (group,) = [g for g in groups if any(r["alert"] == NAME for r in g["rules"])]
    assert group["name"] == "ddpmon-numerics.alerts"
    # step 3 not done: the committed rule files are stale (`make rules`)
    assert render.check(PROM_DIR) != []
    rules = _alerting_rules(generated[render.ALERTS_FILE])
    shipped_docs = [yaml.safe_load(p.read_text())
                    for p in sorted((PROM_DIR / "tests").glob("*.yml"))]
    runbook = (PROM_DIR / "runbook.md").read_text()
    alerts_md = (REPO / "docs" / "alerts.md").read_text(encoding="utf-8")
    scale_out = (REPO / "docs" / "scale-out.md").read_text(encoding="utf-8")
    before = alert_contract.problems(rules, CONTRACT_ALERTS, runbook, shipped_docs, alerts_md,
                                     scale_out)
    assert before == [
        f"{NAME}: in the rules but not the contract list",
        f"{NAME}: no runbook section for #{NAME.lower()}",
        f"{NAME}: no promtool case where it stays quiet",
        f"{NAME}: no promtool case where it fires",
        f"{NAME}: docs/alerts.md's table lacks | {NAME} | warning | 5m |",
        f"{NAME}: not placed in docs/scale-out.md's where-each-rule-runs table",
    ]
    # steps 2 and 3 done, in a scratch copy: the runbook section, the promtool cases, the rule
    # files, the table row and the contract entry
    prom = tmp_path / "prometheus"
    render.write(prom)
    (prom / "tests").mkdir()
    (prom / "tests" / "loss.yml").write_text(CASES)
    runbook += f"\n## {NAME}\n\nWhat it means, what to check, what to do.\n"
    alerts_md += f"\n| {NAME} | warning | 5m | a rank's loss above a million |\n"
    scale_out += f"\n| each shard | {NAME} | it reads one rank's series |\n"
    docs = [*shipped_docs, yaml.safe_load(CASES)]
    after = alert_contract.problems(
        rules, {**CONTRACT_ALERTS, NAME: "warning"}, runbook, docs, alerts_md, scale_out
    )
    assert after == []
    unit = subprocess.run([PROMTOOL, "test", "rules", "loss.yml"], cwd=prom / "tests",
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
