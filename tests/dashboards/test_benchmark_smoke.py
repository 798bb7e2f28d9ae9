"""The 1024-rank benchmark's pipeline, end to end at a tiny size (8 ranks x 15 min).

Keeps ``make bench-dashboards`` working: the synthetic series set must cover every sample of
the golden exposition, promtool must accept the OpenMetrics and the rule backfill, and every
panel query must run against the result.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "dashboards_scale", ROOT / "benchmarks" / "dashboards_scale.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_runs_every_panel_query(tmp_path: Path, capsys) -> None:
    bench = _bench()
    rc = bench.main(
        ["--ranks", "8", "--hours", "0.25", "--repeats", "1", "--workdir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "Series: " in out and "0 of " in out
    rows = [line for line in out.splitlines() if line.startswith("| Run overview |")]
    assert len(rows) >= 40
    # Distributions see every rank; the rank-health table lists them all (problems column).
    assert any(
        "| Rank health, worst first | A |" in r and r.rstrip(" |").endswith(" 8") for r in rows
    ), rows
    # The synthetic duplicated shard (2 ranks) is what the identical-batch panel draws.
    assert any(
        "| Identical batches across ranks | A |" in r and r.rstrip(" |").endswith(" 2")
        for r in rows
    ), rows
