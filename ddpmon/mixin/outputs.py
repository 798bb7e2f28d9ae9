"""Every file ``ddpmon dashboards --write`` produces, and the check that they are current.

Outputs: ``dashboards/*.json`` (Grafana) and ``deploy/kubernetes/*.yaml`` (PodMonitor,
PrometheusRule, dashboards ConfigMap, kustomization), all from one ``MixinConfig``.
"""

from __future__ import annotations

from pathlib import Path

from ddpmon.mixin import dashboards, kubernetes, shipped
from ddpmon.mixin.config import MixinConfig

from .files import diff_files, write_files

DASHBOARD_DIR = shipped.DASHBOARD_DIR
KUBERNETES_DIR = shipped.KUBERNETES_DIR


def generate(cfg: MixinConfig | None = None) -> dict[str, str]:
    """``{path relative to the repository root: text}``."""
    cfg = cfg or MixinConfig()
    boards = {name: dashboards.dumps(doc) for name, doc in dashboards.render_all(cfg).items()}
    out = {f"{DASHBOARD_DIR}/{name}": text for name, text in boards.items()}
    for name, text in kubernetes.manifests(cfg, boards).items():
        out[f"{KUBERNETES_DIR}/{name}"] = text
    return out


def write(root: str | Path, cfg: MixinConfig | None = None) -> list[Path]:
    """Write every output under ``root`` (``dashboards/``, ``deploy/kubernetes/``)."""
    return write_files(root, generate(cfg))


def check(root: str | Path | None = None, cfg: MixinConfig | None = None) -> list[str]:
    """Unified diffs of files that differ from what the config generates (missing = empty).
    ``root`` defaults to the checkout, or the copies shipped in the wheel."""
    return diff_files(root or shipped.root(), generate(cfg))
