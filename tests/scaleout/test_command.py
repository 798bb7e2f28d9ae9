"""``ddpmon scaleout``: bad input is refused before anything starts; the scale figures it prints
come from benchmarks/RESULTS.md. (The path it runs is tests/scaleout/test_sharded_path.py's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddpmon.commands import scaleout


def test_bad_config_is_refused_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "mixin.yaml"
    bad.write_text("rank_down_for: soon\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "scaleout", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}: rank_down_for='soon': expected a duration" in proc.stderr
    assert "VictoriaMetrics" not in proc.stdout  # nothing was started


def test_scale_figures_are_read_from_the_results() -> None:
    lines = scaleout.scale_figures()
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"
    sections = results.read_text().count("\n## Dashboards at ")
    assert len(lines) == sections >= 1, lines
    assert all("ranks: series " in line and "slowest panel " in line for line in lines), lines
    assert not any("?" in line for line in lines), lines
