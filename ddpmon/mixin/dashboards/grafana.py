"""Render a :class:`DashboardSpec` to Grafana JSON with grafana-foundation-sdk.

The SDK is an optional extra (``ddpmon[dashboards]``) and is imported only here, lazily.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.model import DETAIL_UID, DashboardSpec
from ddpmon.mixin.dashboards.promql import base_matchers


def _rank_link(title: str = "Rank detail: rank ${__field.labels.rank}") -> dict[str, Any]:
    return {
        "title": title,
        "url": f"/d/{DETAIL_UID}/ddpmon-rank-detail?var-datasource=${{datasource}}"
        "&var-cluster=${cluster}"
        "&var-run=${__field.labels.run}&var-rank=${__field.labels.rank}&${__url_time_range}",
    }


def render(spec: DashboardSpec, cfg: MixinConfig) -> dict[str, Any]:
    # Lazy: the SDK is an optional extra (``ddpmon[dashboards]``).
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog.encoder import JSONEncoder  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.models import dashboard as dm

    ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    dash = _dashboard(spec, cfg, ds)
    panel_id = 0
    for row in spec.rows:
        panel_id += 1
        dash = dash.with_row(db.Row(row.title).id(panel_id))
        for p in row.panels:
            panel_id += 1
            dash = dash.with_panel(_panel(p, ds, panel_id))

    out = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    _post_process(out, spec)
    return out


def _dashboard(spec: DashboardSpec, cfg: MixinConfig, ds: Any) -> Any:
    """The dashboard without its panels: variables (data source, cluster, run, rank), links,
    annotations."""
    from grafana_foundation_sdk.builders import dashboard as db  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.models import dashboard as dm

    job = base_matchers(cfg)
    cluster_var = (
        db.QueryVariable("cluster")
        .label("Cluster")
        .datasource(ds)
        .query(f"label_values(ddpmon_rank_info{{{job}}}, cluster)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .include_all(True)
        # Matches series without a cluster label too (a single-cluster Prometheus).
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
    )
    run_var = (
        db.QueryVariable("run")
        .label("Run")
        .datasource(ds)
        .query(f'label_values(ddpmon_rank_info{{{job}, cluster=~"$cluster"}}, run)')
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_DESC)
    )
    rank_var = (
        db.QueryVariable("rank")
        .label("Rank")
        .datasource(ds)
        .query(f'label_values(ddpmon_rank_info{{{job}, cluster=~"$cluster", run="$run"}}, rank)')
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NUMERICAL_ASC)
    )
    if spec.rank_multi:
        rank_var = (
            rank_var.multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        )
    ds_var = db.DatasourceVariable("datasource").label("Data source").type("prometheus")
    if cfg.dashboard_datasource:
        name = cfg.dashboard_datasource
        ds_var = ds_var.current(dm.VariableOption(selected=True, text=name, value=name))
    dash = (
        db.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(cfg.dashboard_tags))
        .refresh(cfg.dashboard_refresh)
        .time("now-1h", "now")
        .timezone("utc")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .with_variable(ds_var)
        .with_variable(cluster_var)
        .with_variable(run_var)
        .with_variable(rank_var)
        .link(
            db.DashboardLink("ddpmon dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(list(cfg.dashboard_tags))
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for a in spec.annotations:
        dash = dash.annotation(
            db.AnnotationQuery().name(a.name).datasource(ds).enable(True).icon_color(a.color)
            .expr(a.expr)
        )

    return dash


def _panel(p: Any, ds: Any, panel_id: int) -> Any:
    """One panel: its kind's own options, then what every panel has (size, unit, thresholds,
    the queries)."""
    from grafana_foundation_sdk.builders import dashboard as db  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.builders import prometheus, stat
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as pm

    builder: Any
    if p.kind == "timeseries":
        builder = _timeseries(p)
    elif p.kind == "heatmap":
        builder = _heatmap(p)
    elif p.kind == "table":
        builder = _table(p)
    elif p.kind == "stat":
        builder = stat.Panel()
    else:
        raise ValueError(f"panel {p.title!r}: unknown kind {p.kind!r}")
    builder = (
        builder.id(panel_id)
        .title(p.title)
        .description(p.description)
        .datasource(ds)
        .unit(p.unit)
        .span(p.width)
        .height(p.height)
    )
    steps = [
        dm.Threshold(None, p.base_color), *(dm.Threshold(v, c) for v, c in p.thresholds)
    ]
    builder = builder.thresholds(
        db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)
    )
    for i, query in enumerate(p.queries):
        target = (
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + i))
            .expr(query.expr)
            .legend_format(query.legend or "__auto")
            .format(pm.PromQueryFormat(query.fmt))
        )
        target = target.instant() if query.instant else target.range()
        builder = builder.with_target(target)
    return builder


def _timeseries(p: Any) -> Any:
    from grafana_foundation_sdk.builders import common as cb  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.builders import timeseries
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    builder = (
        timeseries.Panel()
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM)
            .calcs(["lastNotNull", "max"])
            .sort_by("Max")
            .sort_desc(True)
            .show_legend(True)
        )
        .tooltip(
            cb.VizTooltipOptions()
            .mode(cm.TooltipDisplayMode.MULTI)
            .sort(cm.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(0)
        .span_nulls(False)
    )
    if p.log_scale:
        builder = builder.scale_distribution(
            cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(2)
        )
    if p.thresholds:
        builder = builder.thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.DASHED)
        )
    for legend in p.dashed_series:
        # A legend with a label in it ("run p99 {{op}}") names one series per value:
        # match them all by their fixed prefix.
        prefix = legend.split("{{")[0].rstrip()
        builder = builder.override_by_regexp(
            f"^{re.escape(prefix)}( .*)?$",
            [
                dm.DynamicConfigValue(
                    "custom.lineStyle", {"fill": "dash", "dash": [10, 10]}
                ),
                dm.DynamicConfigValue(
                    "color", {"mode": "fixed", "fixedColor": "red"}
                ),
            ],
        )
    return builder


def _heatmap(p: Any) -> Any:
    from grafana_foundation_sdk.builders import common as cb  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.builders import heatmap
    from grafana_foundation_sdk.models import common as cm

    # Bucket heatmaps: y = le, cells = counts. Rank heatmaps: y = rank, cells = value.
    buckets = p.queries[0].fmt == "heatmap"
    builder = (
        heatmap.Panel()
        .calculate(p.distribution)
        .color(
            heatmap.HeatmapColorOptions()
            .mode(_heatmap_enum("HeatmapColorMode", "SCHEME"))
            .scheme("Oranges")
            .scale(_heatmap_enum("HeatmapColorScale", "EXPONENTIAL"))
            .exponent(0.5)
            .steps(64)
        )
        .y_axis(heatmap.YAxisConfig().unit(p.unit if buckets else "none"))
        .cell_values(heatmap.CellValues().unit("short" if buckets else p.unit))
        .show_tooltip()
        .show_legend()
    )
    if p.distribution:
        # Grafana bins the per-rank values: y = value bucket, cells = ranks.
        builder = builder.calculation(
            cb.HeatmapCalculationOptions().y_buckets(
                cb.HeatmapCalculationBucketConfig().scale(
                    cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(2)
                )
            )
        ).y_axis(heatmap.YAxisConfig().unit(p.unit))
        builder = builder.cell_values(heatmap.CellValues().unit("short"))
    elif buckets:
        builder = builder.rows_frame(
            heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE)
        )
    else:
        builder = builder.rows_frame(
            heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.UNKNOWN)
        )
    return builder


def _table(p: Any) -> Any:
    from grafana_foundation_sdk.builders import common as cb  # optional: ddpmon[dashboards]
    from grafana_foundation_sdk.builders import table
    from grafana_foundation_sdk.models import dashboard as dm

    builder = table.Panel()
    if p.columns:
        # One row per rank: merge the per-column queries, name the value columns.
        builder = builder.with_transformation(
            dm.DataTransformerConfig(id_val="merge", options={})
        ).with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {f"Value #{r}": n for r, n in p.columns},
                    "indexByName": {
                        "rank": 0,
                        **{n: i + 1 for i, (_r, n) in enumerate(p.columns)},
                    },
                },
            )
        )
    if p.sort_by:
        builder = builder.sort_by(
            [cb.TableSortByFieldState().display_name(p.sort_by).desc(True)]
        )
    if p.hide_columns:
        builder = builder.with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={"excludeByName": {c: True for c in p.hide_columns}},
            )
        )
    if p.rank_links:
        builder = builder.override_by_name(
            "rank",
            [
                dm.DynamicConfigValue(
                    "links",
                    [
                        {
                            "title": "Rank detail: rank ${__value.raw}",
                            "url": f"/d/{DETAIL_UID}/ddpmon-rank-detail?"
                            "var-datasource=${datasource}&var-cluster=${cluster}"
                            "&var-run=${run}"
                            "&var-rank=${__value.raw}&${__url_time_range}",
                        }
                    ],
                )
            ],
        )
    return builder


def _heatmap_enum(name: str, member: str) -> Any:
    from grafana_foundation_sdk.models import heatmap as hm  # optional: ddpmon[dashboards]

    return getattr(getattr(hm, name), member)


def _post_process(out: dict[str, Any], spec: DashboardSpec) -> None:
    """Fill in what the SDK does not model: annotation title formats and field data links."""
    by_name = {a.name: a.title for a in spec.annotations}
    for ann in out.get("annotations", {}).get("list", []):
        if ann.get("name") in by_name:
            ann["titleFormat"] = by_name[ann["name"]]
            ann["tagKeys"] = "rank,severity"
            ann["step"] = "$__interval"
    panel_specs = {p.title: p for row in spec.rows for p in row.panels}
    for panel in out.get("panels", []):
        ps = panel_specs.get(panel.get("title"))
        if ps is None or panel.get("type") == "row":
            continue
        fc = panel.setdefault("fieldConfig", {"defaults": {}, "overrides": []})
        if ps.rank_links and ps.kind == "timeseries":
            fc["defaults"]["links"] = [_rank_link()]
        if panel.get("options") is None:
            panel["options"] = {}
