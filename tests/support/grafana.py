"""Grafana's variable substitution, emulated for tests and the benchmark (no Grafana runs here).

``panel_queries`` lists every panel query of a rendered dashboard with ``$run``/``$rank`` and
Grafana's built-ins resolved the way Grafana's Prometheus data source resolves them, each with
the coverage its :class:`ddpmon.mixin.dashboards.Query` declares.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ddpmon.mixin import dashboards


class PanelQuery(NamedTuple):
    """One query of one panel with the dashboard variables resolved."""

    title: str
    expr: str
    ref_id: str
    instant: bool
    coverage: str


_VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def _format_value(value: str | Sequence[str], all_value: str | None) -> str:
    if isinstance(value, str):
        if value in ("$__all", "All") and all_value is not None:
            return all_value
        return value
    values = list(value)
    if len(values) == 1:
        return _REGEX_SPECIAL.sub(r"\\\1", values[0])
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", v) for v in values) + ")"


def resolve(expr: str, variables: Mapping[str, Any], *, all_values: Mapping[str, str]) -> str:
    """Substitute dashboard variables the way Grafana's Prometheus data source does:
    a multi-value selection becomes a regex alternation ``(a|b)``, "All" becomes the
    variable's ``allValue``. Unknown variables raise so a query never runs half-resolved."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name[0].isdigit():  # a label_replace capture group such as "$1", not a variable
            return m.group(0)
        if name not in variables:
            raise KeyError(f"variable ${name} has no value in {sorted(variables)}")
        return _format_value(variables[name], all_values.get(name))

    return _VAR_RE.sub(sub, expr)


def panel_queries(
    dashboard: Mapping[str, Any],
    variables: Mapping[str, Any],
    *,
    rate_interval: str = "2m",
    interval: str = "30s",
    range_: str = "1h",
) -> list[PanelQuery]:
    """Every panel query of ``dashboard`` (JSON) with ``variables`` resolved.

    ``variables`` maps ``run``/``rank`` to a value, a list of values, or ``"All"``;
    ``$__rate_interval``, ``$__interval`` and ``$__range`` take the keyword values (Grafana
    derives them from the scrape interval and the panel's step)."""
    all_values = {
        v["name"]: v["allValue"]
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("includeAll") and v.get("allValue")
    }
    env = {
        "cluster": "All",  # the dashboards' default
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
        **variables,
    }
    coverage = {
        (p.title, chr(ord("A") + i)): query.coverage
        for s in dashboards.specs()
        if s.uid == dashboard.get("uid")
        for row in s.rows
        for p in row.panels
        for i, query in enumerate(p.queries)
    }
    out: list[PanelQuery] = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if not target.get("expr") or target.get("hide"):
                continue
            ref = target.get("refId", "")
            out.append(
                PanelQuery(
                    panel["title"],
                    resolve(target["expr"], env, all_values=all_values),
                    ref,
                    bool(target.get("instant")) and not target.get("range"),
                    coverage.get((panel["title"], ref), dashboards.RUN),
                )
            )
    return out


def annotation_queries(
    dashboard: Mapping[str, Any], variables: Mapping[str, Any], *, rate_interval: str = "2m"
) -> list[tuple[str, str]]:
    """``(annotation name, expr)`` for every Prometheus annotation, variables resolved."""
    env = {"cluster": "All", "__rate_interval": rate_interval, "__interval": "30s", **variables}
    return [
        (a["name"], resolve(a["expr"], env, all_values={"rank": ".*", "cluster": ".*"}))
        for a in dashboard.get("annotations", {}).get("list", [])
        if a.get("expr")
    ]


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for panel in panels:
        if panel.get("type") == "row":
            yield from _panels(panel.get("panels", []))
        else:
            yield panel
