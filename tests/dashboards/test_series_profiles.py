"""Every panel and rule works under every ``series_profile``, checked against real stores.

``large`` takes ``ddpmon_grad_group_norm`` off every rank but rank 0. The benchmark's pipeline
(the agent's series set, promtool blocks, the shipped recording rules backfilled, a real
Prometheus; and VictoriaMetrics) runs at 8 ranks shaped like each profile; every panel query of
both dashboards must return as many series under ``large`` as under ``full`` (the rank-detail
rank is rank 1, which exports no group norms of its own under ``large``).
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest
import yaml

from ddpmon import metrics as m
from ddpmon.mixin.render import ALERTS_FILE, RULES_FILE, generate
from tests.dashboards.test_benchmark_smoke import _bench

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="make test installs it")


def _rows(out: str) -> dict[tuple[str, str, str], int]:
    rows = {}
    for line in out.splitlines():
        if line.startswith(("| Run overview |", "| Rank detail |")):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[(cells[0], cells[1], cells[2])] = int(cells[4])
    return rows


def _run(tmp: Path, *extra: str) -> dict[tuple[str, str, str], int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # a sample every 30 s: the straggler records' 1m window holds two (60 s holds one)
        rc = _bench().main(["--ranks", "8", "--hours", "0.25", "--repeats", "1", "--interval", "30",
                            "--workdir", str(tmp), *extra])
    assert rc == 0, out.getvalue()[-3000:]
    rows = _rows(out.getvalue())
    assert len(rows) >= 100
    return rows


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("full"))


def test_rules_and_alerts_never_read_group_norms():
    """So no rule or alert can lose data under ``large``; the global norm (DdpmonGradDesync
    compares it across ranks) stays on every rank in every profile."""
    files = generate()
    for name in (RULES_FILE, ALERTS_FILE):
        for group in yaml.safe_load(files[name])["groups"]:
            for rule in group["rules"]:
                assert m.GRAD_GROUP_NORM.name not in rule["expr"], (name, rule)


def test_every_panel_answers_under_large_as_under_full(full, tmp_path):
    large = _run(tmp_path, "--series-profile", "large")
    assert large.keys() == full.keys()
    differ = {k: (full[k], large[k]) for k in full if full[k] != large[k]}
    assert not differ, differ
    group_panel = ("Rank detail", "Grad norm by module group", "A")
    assert large[group_panel] == full[group_panel] > 0  # rank 1 shows rank 0's group norms


@pytest.mark.skipif(shutil.which("victoria-metrics") is None, reason="make debs installs it")
def test_victoria_metrics_store_answers_every_panel_like_prometheus(full, tmp_path):
    """The 16k-rank benchmark's store: same series per panel as Prometheus at 8 ranks."""
    vm = _run(tmp_path, "--store", "victoria-metrics", "--series-profile", "large")
    differ = {k: (full[k], vm[k]) for k in full if full[k] != vm.get(k)}
    assert not differ, differ
