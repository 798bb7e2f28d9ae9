"""Kubernetes manifests against real schemas; Grafana provisioning files against their shape.

ConfigMap: kubernetes-validate (the Kubernetes OpenAPI schemas, strict). PodMonitor and
PrometheusRule: cloudcoil's prometheus-operator models, generated from the operator's CRDs,
plus a round trip that rejects any field the CRD does not define. Rule content: promtool.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from kubernetes_validate import utils as kv

from ddpmon.mixin import dashboards, kubernetes, render
from ddpmon.mixin.config import MixinConfig


def promop():
    """cloudcoil's prometheus-operator models (3 CPU-s to import: on the worker that runs this
    file only, not on every xdist worker that collects it)."""
    from cloudcoil.models.prometheus_operator import v1

    return v1


ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text())


def unknown_fields(given: Any, known: Any, path: str = "") -> list[str]:
    """Paths present in ``given`` that the model dropped (i.e. the CRD does not define)."""
    out: list[str] = []
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(known, dict) or key not in known:
                out.append(f"{path}.{key}")
            else:
                out += unknown_fields(value, known[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(known, list):
        for i, (a, b) in enumerate(zip(given, known, strict=False)):
            out += unknown_fields(a, b, f"{path}[{i}]")
    return out


def validate_crd(model: type[pydantic.BaseModel], doc: dict[str, Any]) -> None:
    obj = model.model_validate(doc)
    dumped = obj.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert unknown_fields(doc, dumped) == []


def test_configmap_is_a_valid_configmap_with_the_dashboards() -> None:
    doc = load("ddpmon-dashboards-configmap.yaml")
    kv.validate(doc, K8S_VERSION, strict=True)
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(doc["data"]) == set(dashboards.FILENAMES.values())
    for name, text in doc["data"].items():
        assert text == (ROOT / "dashboards" / name).read_text()
        assert json.loads(text)["uid"] in dashboards.FILENAMES
    # kubectl's client-side apply keeps a copy in an annotation limited to 256 KiB.
    assert len(json.dumps(doc)) < 256 * 1024


def test_configmap_validator_can_fail() -> None:
    doc = load("ddpmon-dashboards-configmap.yaml")
    doc["data"]["bad.json"] = {"not": "a string"}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSION, strict=True)


def test_podmonitor_matches_the_crd() -> None:
    doc = load("ddpmon-podmonitor.yaml")
    validate_crd(promop().PodMonitor, doc)
    endpoints = doc["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [
        f"{kubernetes.PORT_PREFIX}{i}" for i in range(kubernetes.LOCAL_RANKS)
    ]
    job = {
        r["replacement"] for e in endpoints for r in e["relabelings"] if r["targetLabel"] == "job"
    }
    assert {f'job="{j}"' for j in job} == {MixinConfig().job_selector}
    # `up` of a dead rank must carry run and rank (RankDown's description, the inhibitions).
    for i, endpoint in enumerate(endpoints):
        sources = {
            r["targetLabel"]: r.get("sourceLabels", []) for r in endpoint["relabelings"]
        }
        assert sources["run"] == ["__meta_kubernetes_pod_label_ddpmon_io_run"]
        ranks = [r for r in endpoint["relabelings"] if r["targetLabel"] == "rank"]
        assert [r["sourceLabels"] for r in ranks] == [
            ["__meta_kubernetes_pod_label_ddpmon_io_rank"],
            [f"__meta_kubernetes_pod_label_ddpmon_io_rank_{i}"],
        ]
        assert all(r["regex"] == "(.+)" for r in ranks)  # an absent label keeps the other


def test_crd_validation_can_fail() -> None:
    doc = load("ddpmon-podmonitor.yaml")
    doc["spec"]["podMetricsEndpoints"][0]["interval"] = "fifteen seconds"
    with pytest.raises(pydantic.ValidationError):
        validate_crd(promop().PodMonitor, doc)
    doc = load("ddpmon-podmonitor.yaml")
    doc["spec"]["podMetricsEndpoints"][0]["scrapeEvery"] = "15s"
    with pytest.raises(AssertionError):
        validate_crd(promop().PodMonitor, doc)


def test_prometheusrule_matches_the_crd_and_the_rule_files(tmp_path: Path) -> None:
    doc = load("ddpmon-prometheusrule.yaml")
    validate_crd(promop().PrometheusRule, doc)
    files = []
    for name in (render.RULES_FILE, render.ALERTS_FILE):
        files += yaml.safe_load((ROOT / "deploy" / "prometheus" / name).read_text())["groups"]
    assert doc["spec"]["groups"] == files
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    promtool = shutil.which("promtool")
    assert promtool
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_kustomization_lists_every_manifest() -> None:
    doc = load("kustomization.yaml")
    assert sorted(doc["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_grafana_provisioning() -> None:
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "ddpmon.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["jsonData"]["timeInterval"]
    dp = yaml.safe_load((prov / "dashboards" / "ddpmon.yaml").read_text())
    (provider,) = dp["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    # Every dashboard picks its data source through the variable, so the provisioned
    # data source (whatever its uid) is offered.
    for name in dashboards.FILENAMES.values():
        doc = json.loads((ROOT / "dashboards" / name).read_text())
        (var,) = [v for v in doc["templating"]["list"] if v["type"] == "datasource"]
        assert var["query"] == source["type"]
