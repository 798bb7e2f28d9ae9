"""Every panel and annotation query, variables resolved, is accepted by a real Prometheus."""

from __future__ import annotations

import httpx
import pytest

from ddpmon.mixin import dashboards as d
from tests.support import grafana

BOARDS = {doc["uid"]: doc for doc in d.render_all().values()}
VARIABLES = {
    d.OVERVIEW_UID: {"run": "r1", "rank": ["0", "1"]},
    d.DETAIL_UID: {"run": "r1", "rank": "1"},
}


def _query(url: str, expr: str) -> httpx.Response:
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)


def test_prometheus_rejects_bad_promql(empty_prometheus: str) -> None:
    """Control: the checker below can fail."""
    resp = _query(empty_prometheus, "sum by (run (rate(x[$__rate_interval]))")
    assert resp.status_code == 400 and resp.json()["errorType"] == "bad_data"


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_every_query_parses(empty_prometheus: str, uid: str) -> None:
    doc = BOARDS[uid]
    queries = [(q.title, q.expr) for q in grafana.panel_queries(doc, VARIABLES[uid])]
    queries += grafana.annotation_queries(doc, VARIABLES[uid])
    queries += [
        (
            f"variable {v['name']}",
            v["query"].replace("$run", "r1"),
        )
        for v in doc["templating"]["list"]
        if v["type"] == "query"
    ]
    failures = []
    for title, expr in queries:
        if expr.startswith("label_values("):
            # Grafana's own function: check its selector instead.
            expr = expr[len("label_values(") : expr.rindex(",")]
        resp = _query(empty_prometheus, expr)
        if resp.status_code != 200 or resp.json().get("status") != "success":
            failures.append(f"{title}: {expr}\n  -> {resp.text}")
    assert not failures, "\n".join(failures)
