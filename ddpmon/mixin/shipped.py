"""Where the mixin's committed outputs live: the checkout, or the copies packaged in the wheel.

In a checkout, ``deploy/`` and ``dashboards/`` at the repository root are the committed outputs
(``--check`` compares against them). ``ddpmon/mixin/shipped/`` holds links to both, so the wheel
packages the same files (rules, alerts, runbook, promtool tests, Prometheus and Alertmanager
configs, dashboards, Grafana provisioning, Kubernetes manifests) and an installed ``ddpmon``
finds them without a checkout.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent / "shipped"
"""Holds ``deploy/`` and ``dashboards/`` (links in a checkout, real files in a wheel)."""
_REPO = Path(__file__).resolve().parents[2]

PROMETHEUS_DIR = "deploy/prometheus"
ALERTMANAGER_YML = "deploy/alertmanager/alertmanager.yml"
PROMETHEUS_YML = "deploy/prometheus/prometheus.yml"
PROMETHEUS_SLURM_YML = "deploy/prometheus/prometheus-slurm.yml"
KUBERNETES_DIR = "deploy/kubernetes"
DASHBOARD_DIR = "dashboards"
GRAFANA_PROVISIONING_DIR = "deploy/grafana/provisioning"


def checkout_root() -> Path | None:
    """The repository root when ddpmon runs from a checkout (editable install), else None."""
    if (_REPO / "pyproject.toml").is_file() and (_REPO / PROMETHEUS_DIR).is_dir():
        return _REPO
    return None


def root() -> Path:
    """The directory holding ``deploy/`` and ``dashboards/``: the checkout if there is one,
    else the packaged copy."""
    return checkout_root() or PACKAGE_ROOT


GENERATED = ((DASHBOARD_DIR, "*.json"), (KUBERNETES_DIR, "*.yaml"))
"""The outputs of ``ddpmon dashboards`` as they ship: (folder, pattern) under :func:`root`."""


def generated_outputs() -> dict[str, str]:
    """``{relative path: text}`` of the dashboards and manifests that ship, generated from the
    default config: what ``ddpmon dashboards --write`` writes, read without the Grafana SDK."""
    base = root()
    out = {}
    for folder, pattern in GENERATED:
        for found in sorted((base / folder).glob(pattern)):
            out[f"{folder}/{found.name}"] = found.read_text(encoding="utf-8")
    if not out:
        raise FileNotFoundError(f"no dashboards in this ddpmon installation ({base})")
    return out


def path(rel: str) -> Path:
    """A shipped file or directory, e.g. ``path(PROMETHEUS_YML)``; raises if it is missing."""
    found = root() / rel
    if not found.exists():
        raise FileNotFoundError(
            f"{rel} is not in this ddpmon installation ({root()}); reinstall ddpmon"
        )
    return found
