"""`ddpmon report` opened in a real headless Chromium (Debian's `chromium`, driven by Playwright
with the system executable): no console errors, no network request, every plot rendered, the
first failure named, a screenshot taken."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.ports import free_port_pair

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (scripts/install-debs.sh)"
)


def report(run: Path, out: Path, *extra: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "report", str(run), "-o", str(out), *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def open_in_browser(page_path: Path, shot: Path) -> dict:
    """Load the page; return console errors, requests, plot stats and the failure text."""
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load")
            plots = page.eval_on_selector_all(
                "figure.plot",
                """figs => figs.map(f => {
                    const svg = f.querySelector('svg');
                    const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
                    return {id: f.id, width: box.width, height: box.height,
                            shapes: svg ? svg.querySelectorAll('path,image,use').length : 0};
                })""",
            )
            failure = " ".join(
                page.eval_on_selector_all("#first-failure", "els => els.map(e => e.textContent)")
            )
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    return {"errors": errors, "requests": requests, "plots": plots, "failure": failure}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("nanrun")
    proc = subprocess.run(
        [
            sys.executable, "-m", "ddpmon.cli", "demo", "--nproc", "2", "--steps", "12",
            "--step-delay", "0", "--port", str(free_port_pair()), "--run-dir", str(d),
            "--run-id", "nan", "--sd-dir", "none", "--no-progress",
            "--inject", "nan@rank1:step5",
        ],
        capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d / "nan"


EXPECTED_PLOTS = {"plot-loss", "plot-norms", "plot-groups", "plot-scale", "plot-time",
                  "plot-memory", "plot-collectives"}
DEMO_PLOTS = EXPECTED_PLOTS | {
    # a real run's per-group update figures (every 10 steps by default) and its goodput
    "plot-update_ratios", "plot-exp_avg_norms", "plot-goodput"}


def test_report_of_a_nan_run_renders_and_names_the_first_failure(nan_run, tmp_path):
    page = tmp_path / "report.html"
    report(nan_run, page)
    text = page.read_text()
    assert "<script" not in text and "<link" not in text
    # every reference is inside the page: fragments (#id) or data: URIs, nothing to fetch
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', text)
    assert all(r.startswith(("#", "data:")) for r in refs), [r[:40] for r in refs]
    shot = tmp_path / "report.png"
    got = open_in_browser(page, shot)
    assert got["errors"] == []
    assert [u for u in got["requests"] if not u.startswith(("file:", "data:"))] == []
    assert {p["id"] for p in got["plots"]} == DEMO_PLOTS
    for plot in got["plots"]:
        assert plot["width"] > 300 and plot["height"] > 100 and plot["shapes"] > 5, plot
    assert "rank 1" in got["failure"] and "step 5" in got["failure"], got["failure"]
    assert shot.stat().st_size > 20_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_thousand_ranks_stay_readable(tmp_path):
    """1024 synthetic rank histories: bands for the many, lines for the outliers only."""
    from ddpmon.metrics.state import StepRecord
    from ddpmon.recorder.history import HistoryWriter, row_of

    run = tmp_path / "big"
    run.mkdir()
    (run / "manifest.json").write_text('{"topology": {"world_size": 1024}}')
    groups = ("embed", "head")
    rng = np.random.default_rng(0)
    for rank in range(1024):
        w = HistoryWriter(run / f"history.rank{rank}.arrow", groups, meta={"rank": str(rank)},
                          flush_seconds=0.01)
        slow = 3.0 if rank == 777 else 1.0  # one straggler
        for s in range(40):
            rec = StepRecord(
                step=s, wall_time=float(s), duration_seconds=0.1 * slow + 0.01 * rng.random(),
                data_wait_seconds=0.001, loss=2.0 / (1 + s), grad_norm=1.0,
                grad_local_norm=1.0 + 0.05 * rng.random(), group_norms={"embed": 0.5, "head": 0.8},
                loss_scale=65536.0, collective_seconds={"all_reduce": [0.001 * (1 + rng.random())]},
            )
            w.put(row_of(rec, groups, 1 << 30))
        w.close()
    page = tmp_path / "big.html"
    report(run, page)
    text = page.read_text()
    assert "p5-p95" in text and "rank 777 (outlier)" in text
    assert text.count("(outlier)") == 1  # ordinary noise draws no line; the straggler does
    assert text.count("rank 1000") == 0  # no line per rank
    assert len(text) < 3_000_000
    got = open_in_browser(page, tmp_path / "big.png")
    assert got["errors"] == [] and len(got["plots"]) == len(EXPECTED_PLOTS)
    assert all(p["shapes"] > 5 for p in got["plots"])
