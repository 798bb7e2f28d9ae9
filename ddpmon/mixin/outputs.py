"""Every file ``ddpmon dashboards --write`` produces, and the check that they are current.

Outputs: ``dashboards/*.json`` (Grafana) and ``deploy/kubernetes/*.yaml`` (PodMonitor,
PrometheusRule, dashboards ConfigMap, kustomization), all from one ``MixinConfig``.
"""

from __future__ import annotations

from pathlib import Path

from ddpmon.mixin import dashboards, kubernetes
from ddpmon.mixin.config import MixinConfig

from .files import diff_files, write_files

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = "dashboards"
KUBERNETES_DIR = "deploy/kubernetes"


def generate(cfg: MixinConfig | None = None) -> dict[str, str]:
    """``{path relative to the repository root: text}``."""
    cfg = cfg or MixinConfig()
    boards = {name: dashboards.dumps(doc) for name, doc in dashboards.render_all(cfg).items()}
    out = {f"{DASHBOARD_DIR}/{name}": text for name, text in boards.items()}
    for name, text in kubernetes.manifests(cfg, boards).items():
        out[f"{KUBERNETES_DIR}/{name}"] = text
    return out


def write(root: str | Path = REPO_ROOT, cfg: MixinConfig | None = None) -> list[Path]:
    return write_files(root, generate(cfg))


def check(root: str | Path = REPO_ROOT, cfg: MixinConfig | None = None) -> list[str]:
    """Unified diffs of files that differ from what the config generates (missing = empty)."""
    return diff_files(root, generate(cfg))
