"""Structure of the generated dashboards: units, data source, variables, rows, links, scale."""

from __future__ import annotations

import re

import pytest

from ddpmon.mixin import dashboards as d
from ddpmon.mixin.config import MixinConfig
from tests.support import grafana

BOARDS = {doc["uid"]: doc for doc in d.render_all().values()}
RANGE = re.compile(r"\[([^\]]*)\]")
RUN_AGG = re.compile(  # per run, or per run and op or goodput bucket (11): bounded at any scale
    r"^((sum|max|min|count|quantile) by \(run(, op|, bucket)?\) "
    r"|histogram_quantile\([0-9.]+, sum by \(run(, op)?, le\))"
    r"|^run:ddpmon_\w+:\w+\{"
)
LAYERS = ["Numerics", "Data supply", "Memory", "Communication"]


def panels(doc: dict) -> list[dict]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def exprs(doc: dict) -> list[str]:
    out = [t["expr"] for p in panels(doc) for t in p["targets"]]
    out += [a["expr"] for a in doc["annotations"]["list"]]
    return out


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_identity_tags_and_variables(uid: str) -> None:
    doc = BOARDS[uid]
    assert doc["title"] in (d.OVERVIEW_TITLE, d.DETAIL_TITLE)
    assert doc["tags"] == MixinConfig().dashboard_tags
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert list(variables) == ["datasource", "cluster", "run", "rank"]
    assert variables["cluster"]["includeAll"] and variables["cluster"]["allValue"] == ".*"
    assert doc["timezone"] == "utc"
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "ddpmon_rank_info" in variables["rank"]["query"]
    assert '$run' in variables["rank"]["query"]
    if uid == d.OVERVIEW_UID:
        assert variables["rank"]["multi"] and variables["rank"]["includeAll"]
        assert variables["rank"]["allValue"] == ".*"


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_every_panel_has_unit_datasource_and_queries(uid: str) -> None:
    doc = BOARDS[uid]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(doc):
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        assert p["description"], p["title"]
        assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p["targets"]:
            assert t["expr"] and t["refId"], p["title"]


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_rates_use_rate_interval(uid: str) -> None:
    for expr in exprs(BOARDS[uid]):
        for window in RANGE.findall(expr):
            assert window in ("$__rate_interval", "$__range", "$__range:"), expr
        # The whole range only ranks series once (at its end) or reads the last value.
        for m in re.finditer(r"\[\$__range:?\]", expr):
            after = expr[m.end() :]
            assert after.startswith(" @ end()") or "last_over_time" in expr, expr
        if re.search(r"\b(rate|irate|increase)\(", expr):
            # Per interval, or once over the whole range (instant stats).
            assert "[$__rate_interval]" in expr or "[$__range] @ end()" in expr, expr


def test_overview_rows_follow_the_layers() -> None:
    rows = [p["title"] for p in BOARDS[d.OVERVIEW_UID]["panels"] if p["type"] == "row"]
    assert [r for r in rows if r in LAYERS] == LAYERS
    assert rows[0] == "Run"
    detail_rows = [p["title"] for p in BOARDS[d.DETAIL_UID]["panels"] if p["type"] == "row"]
    assert [r for r in detail_rows if r in LAYERS] == LAYERS
    assert "GPU" in detail_rows


def test_overview_has_the_issue_panels() -> None:
    titles = {p["title"] for p in panels(BOARDS[d.OVERVIEW_UID])}
    for needed in (
        "Rank health, worst first",
        "Down or missing ranks",
        "Agent probe errors",
        "Versions",
        "Loss",
        "Global grad norm",
        "Grad-norm spread across ranks",
        "Local pre-all-reduce grad norm per rank",
        "Non-finite steps",
        "Non-finite origin ranks",
        "Loss scale per rank",
        "Skipped steps",
        "Data wait per rank",
        "Steps/s per rank",
        "Ranks with identical batches",
        "Identical batches across ranks",
        "Allocator memory per rank",
        "Device memory (NVML)",
        "Headroom to OOM",
        "Collective mean across ranks",
        "Collective p99 across ranks",
        "Collective latency per op",
        "Collective bytes",
        "Straggler slowdown vs the run's median rank",
        "Stragglers, slowest first",
        "Collective mean by node",
        "OOMs and allocator retries",
        "Step drift between ranks",
    ):
        assert needed in titles, needed


def test_annotations_line_up_alerts_nonfinite_and_skipped() -> None:
    for doc in BOARDS.values():
        ann = {a["name"]: a for a in doc["annotations"]["list"]}
        assert set(ann) == {"Firing ddpmon alerts", "Non-finite steps", "Skipped steps",
                            "Checkpoints", "Restarts"}
        assert 'ALERTS{alertname=~"Ddpmon.*"' in ann["Firing ddpmon alerts"]["expr"]
        assert "ddpmon_grad_nonfinite_origin_steps_total" in ann["Non-finite steps"]["expr"]
        assert "ddpmon_steps_skipped_total" in ann["Skipped steps"]["expr"]
        assert "changes(ddpmon_checkpoint_last_timestamp_seconds" in ann["Checkpoints"]["expr"]
        assert "changes(ddpmon_attempt" in ann["Restarts"]["expr"]
        for a in ann.values():
            assert a["enable"] and a["datasource"]["uid"] == "${datasource}"


def test_overview_links_to_rank_detail() -> None:
    doc = BOARDS[d.OVERVIEW_UID]
    text = str(doc)
    assert f"/d/{d.DETAIL_UID}/" in text
    ranks = next(p for p in panels(doc) if p["title"] == "Rank health, worst first")
    overrides = ranks["fieldConfig"]["overrides"]
    (override,) = [o for o in overrides if o["matcher"]["options"] == "rank"]
    links = override["properties"][0]["value"]
    assert "var-rank=${__value.raw}" in links[0]["url"]
    linked = [p for p in panels(doc) if p["fieldConfig"]["defaults"].get("links")]
    assert len(linked) >= 10


def test_per_rank_overview_panels_are_bounded_at_scale() -> None:
    """At 1024 ranks a time series panel draws only k ranks (or nodes) or run aggregates."""
    k = MixinConfig().dashboard_topk
    spec = d.specs()[0]
    for row in spec.rows:
        for p in row.panels:
            if p.kind != "timeseries":
                continue
            for q in p.queries:
                bounded = re.search(
                    rf" and on \((rank|node)\) (topk|bottomk)\({k}, ", q.expr
                ) or RUN_AGG.match(q.expr)
                assert bounded, (p.title, q.expr)


def test_dcgm_join_by_gpu_uuid() -> None:
    detail = BOARDS[d.DETAIL_UID]
    dcgm = [t["expr"] for p in panels(detail) for t in p["targets"] if "DCGM_" in t["expr"]]
    assert dcgm
    for expr in dcgm:
        assert 'label_replace(ddpmon_rank_info{' in expr and '"gpu_uuid"' in expr
        assert "on (UUID)" in expr


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_panel_queries_resolve_every_variable(uid: str) -> None:
    variables = {"run": "r1", "rank": ["0", "1"] if uid == d.OVERVIEW_UID else "3"}
    queries = grafana.panel_queries(BOARDS[uid], variables)
    assert len(queries) == sum(len(p["targets"]) for p in panels(BOARDS[uid]))
    for q in queries:
        assert "$" not in q.expr.replace('"$1"', ""), q
        assert q.coverage in d.COVERAGES
    joined = " ".join(q.expr for q in queries)
    assert 'run="r1"' in joined
    assert ('rank=~"(0|1)"' if uid == d.OVERVIEW_UID else 'rank="3"') in joined
    every = grafana.panel_queries(BOARDS[uid], {"run": "r1", "rank": "All"})
    if uid == d.OVERVIEW_UID:
        assert 'rank=~".*"' in " ".join(q.expr for q in every)


def test_resolve_rejects_unknown_variables() -> None:
    with pytest.raises(KeyError):
        grafana.resolve("up{x=\"$nope\"}", {}, all_values={})


def test_recorded_series_come_from_the_shipped_recording_rules() -> None:
    """Heavy per-rank histogram math and run-wide medians are read from recording rules; those
    must exist, and every rule reads only records that a rule before it writes (Prometheus
    evaluates a group's rules in order, each seeing the ones before it: the
    straggler records chain so that none reads every rank's series twice). The chains stay
    short (at most 4 records deep): the benchmarks backfill them level by level."""
    from ddpmon.mixin.rules import recording_rules

    groups = recording_rules(MixinConfig())
    names = {r["record"] for g in groups for r in g["rules"]}
    used = set()
    for doc in BOARDS.values():
        for expr in exprs(doc):
            used |= set(re.findall(RECORD, expr))
    assert used, "dashboards read no recording rule"
    assert used <= names, f"{sorted(used - names)} are not shipped recording rules"
    depth: dict[str, int] = {}
    written: set[str] = set()
    for g in groups:
        for rule in g["rules"]:
            inner = set(re.findall(RECORD, rule["expr"]))
            assert inner <= written, f"{rule['record']} reads {sorted(inner - written)} before it"
            level = 1 + max((depth[x] for x in inner), default=0)
            depth[rule["record"]] = max(depth.get(rule["record"], 0), level)
            written.add(rule["record"])
    assert max(depth.values()) <= 4, depth


RECORD = r"\b(?:rank|run):ddpmon_[a-z0-9_]+:[a-z0-9_]+"


def _panel(uid: str, title: str) -> dict:
    return next(p for p in panels(BOARDS[uid]) if p["title"] == title)


def _base_color(panel: dict) -> str:
    return panel["fieldConfig"]["defaults"]["thresholds"]["steps"][0]["color"]


def test_worst_first_rank_health_table() -> None:
    table = _panel(d.OVERVIEW_UID, "Rank health, worst first")
    assert table["options"]["sortBy"] == [{"displayName": "problems", "desc": True}]
    assert [t["id"] for t in table["transformations"]][:2] == ["merge", "organize"]
    renamed = table["transformations"][1]["options"]["renameByName"]
    assert set(renamed.values()) >= {"problems", "up", "heartbeat age s", "steps behind",
                                     "slowdown", "data wait share", "memory headroom",
                                     "firing alerts"}
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])
    down = _panel(d.OVERVIEW_UID, "Down or missing ranks")
    assert "up{" in down["targets"][0]["expr"] and "== 0" in down["targets"][0]["expr"]


def test_units_and_colours() -> None:
    """The unit and colour defects of issue 15: power in watts, XID not a percentage, no OOM
    count on a ratio axis, red for "no" and for missing ranks, table legends with last/max."""
    assert _panel(d.DETAIL_UID, "GPU power (NVML)")["fieldConfig"]["defaults"]["unit"] == "watt"
    temp = _panel(d.DETAIL_UID, "GPU temperature (NVML)")
    assert temp["fieldConfig"]["defaults"]["unit"] == "celsius" and len(temp["targets"]) == 1
    xid = _panel(d.DETAIL_UID, "DCGM: last XID error")
    assert xid["fieldConfig"]["defaults"]["unit"] == "none"
    dcgm = _panel(d.DETAIL_UID, "DCGM: this rank's GPU")
    assert not any("XID" in t["expr"] for t in dcgm["targets"])
    headroom = _panel(d.OVERVIEW_UID, "Headroom to OOM")
    assert not any("ooms" in t["expr"] for t in headroom["targets"])
    for uid, title in ((d.DETAIL_UID, "Collectors"), (d.DETAIL_UID, "Up"),
                       (d.OVERVIEW_UID, "Ranks reporting")):
        assert _base_color(_panel(uid, title)) == "red", title
    for doc in BOARDS.values():
        for p in panels(doc):
            if p["type"] == "timeseries":
                legend = p["options"]["legend"]
                assert legend["displayMode"] == "table", p["title"]
                assert legend["calcs"] == ["lastNotNull", "max"], p["title"]


def test_no_top_and_bottom_of_the_same_series() -> None:
    for p in panels(BOARDS[d.OVERVIEW_UID]):
        tops = {m for t in p["targets"] for m in re.findall(r"topk\(\d+, \w+\((\w+)", t["expr"])}
        bottoms = {
            m for t in p["targets"] for m in re.findall(r"bottomk\(\d+, \w+\((\w+)", t["expr"])
        }
        assert not tops & bottoms, p["title"]


def test_distributions_not_rows_per_rank() -> None:
    """A heatmap bins ranks (Grafana's calculation) or reads per-run rank counts by bucket
    (``le``, recorded by the ruler); never one row per rank."""
    heatmaps = [p for p in panels(BOARDS[d.OVERVIEW_UID]) if p["type"] == "heatmap"]
    assert heatmaps, "the overview has no heatmap to check"
    for p in heatmaps:
        by_le = all(t["format"] == "heatmap" and "by (le)" in t["expr"] for t in p["targets"])
        assert p["options"]["calculate"] is True or by_le, p["title"]


def test_alert_annotation_is_per_run_not_per_series() -> None:
    for doc in BOARDS.values():
        (alerts,) = [a for a in doc["annotations"]["list"] if a["name"] == "Firing ddpmon alerts"]
        assert alerts["expr"].startswith("count by (run, alertname, severity) (ALERTS{")
