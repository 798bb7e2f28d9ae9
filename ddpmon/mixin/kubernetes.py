"""Kubernetes manifests for prometheus-operator and the Grafana sidecar, built from the mixin.

The PrometheusRule carries the same rule groups as ``deploy/prometheus/*.yml`` and the ConfigMap
the same dashboard JSON as ``dashboards/``: all are rendered from one ``MixinConfig`` by one
command, so the in-cluster copies cannot drift from the files.
"""

from __future__ import annotations

from typing import Any

import yaml

from ddpmon.mixin.alerts import alert_groups
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import recording_rules

LABELS = {"app.kubernetes.io/name": "ddpmon", "app.kubernetes.io/part-of": "ddpmon"}
POD_LABEL = "ddpmon.io/monitor"
"""Pods of a training job carry ``ddpmon.io/monitor: "true"`` to be scraped."""
PORT_PREFIX = "ddpmon-"
"""Container ports are named ``ddpmon-<LOCAL_RANK>`` (port ``7470 + LOCAL_RANK``)."""
LOCAL_RANKS = 8
"""Ranks per pod the PodMonitor covers (one per GPU of an 8-GPU node)."""
RUN_LABEL = "ddpmon.io/run"
"""Pod label holding the run id (the agent's ``run_id``), copied to the targets' ``run``."""
RANK_LABEL = "ddpmon.io/rank"
"""Pod label holding the global rank of a one-rank pod; a pod of several ranks gives rank of its
local rank ``i`` in ``ddpmon.io/rank-<i>``. Copied to the targets' ``rank``, so ``up`` (hence
DdpmonRankDown and its inhibitions) names the run and rank even when the process is gone."""


def _meta(pod_label: str) -> str:
    """Prometheus' meta label for a pod label (non-alphanumerics become underscores)."""
    return "__meta_kubernetes_pod_label_" + "".join(
        ch if ch.isalnum() else "_" for ch in pod_label
    )


def _job_name(cfg: MixinConfig) -> str:
    """The value of ``job=`` in ``cfg.job_selector`` so in-cluster series match the rules."""
    selector = cfg.job_selector.strip()
    if not selector.startswith('job="') or not selector.endswith('"') or "," in selector:
        raise ValueError(
            f"job_selector={cfg.job_selector!r}: the PodMonitor needs a plain job=\"NAME\" selector"
        )
    return selector[len('job="') : -1]


def pod_monitor(cfg: MixinConfig, *, interval: str = "15s") -> dict[str, Any]:
    job = _job_name(cfg)
    endpoints = []
    for local_rank in range(LOCAL_RANKS):
        endpoints.append(
            {
                "port": f"{PORT_PREFIX}{local_rank}",
                "path": "/metrics",
                "interval": interval,
                # The agent's own run/rank labels are authoritative.
                "honorLabels": True,
                "relabelings": [
                    {"action": "replace", "targetLabel": "job", "replacement": job},
                    {
                        "action": "replace",
                        "sourceLabels": [_meta(RUN_LABEL)],
                        "regex": "(.+)",
                        "targetLabel": "run",
                    },
                    {
                        "action": "replace",
                        "sourceLabels": [_meta(RANK_LABEL)],
                        "regex": "(.+)",
                        "targetLabel": "rank",
                    },
                    {
                        "action": "replace",
                        "sourceLabels": [_meta(f"{RANK_LABEL}-{local_rank}")],
                        "regex": "(.+)",
                        "targetLabel": "rank",
                    },
                    {
                        "action": "replace",
                        "targetLabel": "local_rank",
                        "replacement": str(local_rank),
                    },
                    {
                        "action": "replace",
                        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                        "targetLabel": "node",
                    },
                    {
                        "action": "replace",
                        "sourceLabels": ["__meta_kubernetes_pod_name"],
                        "targetLabel": "pod",
                    },
                ],
            }
        )
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "ddpmon", "labels": dict(LABELS)},
        "spec": {
            "selector": {"matchLabels": {POD_LABEL: "true"}},
            "namespaceSelector": {"any": True},
            "podMetricsEndpoints": endpoints,
        },
    }


def prometheus_rule(cfg: MixinConfig) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "ddpmon", "labels": {**LABELS, "role": "alert-rules"}},
        "spec": {"groups": [*recording_rules(cfg), *alert_groups(cfg)]},
    }


def dashboards_config_map(dashboards: dict[str, str]) -> dict[str, Any]:
    """``dashboards`` maps file name to JSON text, exactly as written under ``dashboards/``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "ddpmon-dashboards",
            # The Grafana sidecar (kiwigrid k8s-sidecar, as in kube-prometheus-stack) loads every
            # ConfigMap with this label; the annotation picks the folder.
            "labels": {**LABELS, "grafana_dashboard": "1"},
            "annotations": {"grafana_folder": "ddpmon"},
        },
        "data": dict(sorted(dashboards.items())),
    }


def kustomization(files: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(files),
    }


class _Dumper(yaml.SafeDumper):
    """Block style, insertion order, multi-line strings (PromQL, JSON) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(doc: dict[str, Any]) -> str:
    header = (
        "# Generated by `ddpmon dashboards --write` from ddpmon/mixin; do not edit by hand.\n"
    )
    return header + yaml.dump(
        doc, Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True
    )


def manifests(cfg: MixinConfig, dashboards: dict[str, str]) -> dict[str, str]:
    """``{file name: YAML}`` for ``deploy/kubernetes/``."""
    docs = {
        "ddpmon-podmonitor.yaml": pod_monitor(cfg),
        "ddpmon-prometheusrule.yaml": prometheus_rule(cfg),
        "ddpmon-dashboards-configmap.yaml": dashboards_config_map(dashboards),
    }
    out = {name: to_yaml(doc) for name, doc in docs.items()}
    out["kustomization.yaml"] = to_yaml(kustomization(list(docs)))
    return out

