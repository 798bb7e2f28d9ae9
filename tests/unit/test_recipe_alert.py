"""docs/architecture.md's "Add an alert", held without a Prometheus: its example, added to its
layer's module as step 1 says, reaches the generated rules (in its layer's group, with its
``for:``, severity and runbook link) and the Kubernetes PrometheusRule, and the committed rule
files are stale until ``make rules`` (step 3). The promtool half is
tests/alerts/test_alert_recipe.py."""

from __future__ import annotations

import yaml

from ddpmon.mixin import kubernetes, render
from ddpmon.mixin.alerts import numerics
from ddpmon.mixin.config import MixinConfig
from tests.support.contract import PROM_DIR
from tests.support.recipe_code import recipe_code

NAME = "DdpmonLossAboveAMillion"


def _example():
    scope: dict = {"__name__": "recipe"}
    exec(compile(recipe_code("Add an alert"), "docs/architecture.md", "exec"), scope)  # noqa: S102
    return scope["loss_above_a_million"]


def test_the_alert_recipe_reaches_the_generated_rules(monkeypatch):
    example = _example()
    assert render.check(PROM_DIR) == []  # the committed files are current before
    shipped = numerics.alerts
    monkeypatch.setattr(numerics, "alerts", lambda c: [*shipped(c), example(c)])
    cfg = MixinConfig()
    groups = yaml.safe_load(render.generate(cfg)[render.ALERTS_FILE])["groups"]
    (group,) = [g for g in groups if any(r.get("alert") == NAME for r in g["rules"])]
    assert group["name"] == "ddpmon-numerics.alerts"
    (rule,) = [r for r in group["rules"] if r.get("alert") == NAME]
    assert rule["for"] == "5m" and rule["labels"]["severity"] == "warning"
    assert "ddpmon_loss" in rule["expr"] and "> 1e6" in rule["expr"]
    assert rule["annotations"]["runbook_url"] == f"{cfg.runbook_base_url}#{NAME.lower()}"
    assert rule["annotations"]["summary"] == "A rank's loss is above a million."
    # the Kubernetes PrometheusRule (`make dashboards`) carries the same groups
    kube = kubernetes.prometheus_rule(cfg)
    kube_names = [r.get("alert") for g in kube["spec"]["groups"] for r in g["rules"]]
    assert NAME in kube_names
    # step 3 not done: `make rules` would rewrite the committed files
    assert any(NAME in diff for diff in render.check(PROM_DIR))


def test_the_alert_is_not_there_without_the_recipe():
    """Not vacuous: the shipped rules have no such alert."""
    groups = yaml.safe_load(render.generate(MixinConfig())[render.ALERTS_FILE])["groups"]
    assert NAME not in [r.get("alert") for g in groups for r in g["rules"]]
