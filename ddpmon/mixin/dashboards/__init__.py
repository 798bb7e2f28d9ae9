"""Grafana dashboards as code: "ddpmon / Run overview" and "ddpmon / Rank detail".

Per dashboard, the queries (``queries/<name>.py``) are apart from the layout (``<name>.py``),
which builds plain :class:`PanelSpec` data; ``grafana.py`` renders it with grafana-foundation-sdk.
Selectors and thresholds come from :class:`ddpmon.mixin.config.MixinConfig`, shared with the
alert and recording rules. Regenerate with ``ddpmon dashboards --write``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards import detail, overview
from ddpmon.mixin.dashboards.grafana import render
from ddpmon.mixin.dashboards.model import (
    ANY,
    COVERAGES,
    DCGM,
    DETAIL_TITLE,
    DETAIL_UID,
    DUP_DATA,
    EVERY_RANK,
    EXEMPT_REASONS,
    FAULT,
    FILENAMES,
    GPU,
    OVERVIEW_TITLE,
    OVERVIEW_UID,
    QUIET,
    RUN,
    Annotation,
    DashboardSpec,
    PanelSpec,
    Query,
    RowSpec,
)

__all__ = [
    "ANY", "QUIET",
    "COVERAGES", "DCGM", "DETAIL_TITLE", "DETAIL_UID", "DUP_DATA", "EVERY_RANK",
    "EXEMPT_REASONS", "FAULT", "FILENAMES", "GPU", "OVERVIEW_TITLE", "OVERVIEW_UID", "RUN",
    "Annotation", "DashboardSpec", "PanelSpec", "Query", "RowSpec",
    "dumps", "render_all", "specs",
]


def specs(cfg: MixinConfig | None = None) -> tuple[DashboardSpec, DashboardSpec]:
    """Both dashboards as data: (overview, rank detail)."""
    cfg = cfg or MixinConfig()
    return overview.spec(cfg), detail.spec(cfg)


def render_all(cfg: MixinConfig | None = None) -> dict[str, dict[str, Any]]:
    """``{filename: dashboard JSON}`` for both dashboards (needs the ``dashboards`` extra)."""

    cfg = cfg or MixinConfig()
    return {FILENAMES[s.uid]: render(s, cfg) for s in specs(cfg)}


def dumps(dashboard: Mapping[str, Any]) -> str:
    """Stable serialisation: sorted keys, two-space indent, trailing newline."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
