"""The helpers that set another ddpmon beside this one in a benchmark
(``benchmarks/side_by_side.py``, used by ``before_after.py`` and ``host_cost_vs_first.py``):
the older package comes out of git whole, the figures are read from the rows the harnesses
really print, and a bad reference fails clearly. Also the bootstrap of
``slow_stuck_cost.py``: its interval holds a known shift. No timing is asserted."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import overhead  # noqa: E402  (benchmarks/, the harness whose table is read)
import side_by_side  # noqa: E402


def test_extract_takes_the_whole_package_of_a_commit(tmp_path: Path) -> None:
    side_by_side.extract("HEAD", tmp_path)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", "HEAD",
                             "ddpmon"], capture_output=True, text=True, check=True).stdout.split()
    # every tracked path, symlinks included (mixin/shipped links outside the package)
    assert listed and all(os.path.lexists(tmp_path / name) for name in listed)


def test_extract_of_an_unknown_commit_raises(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        side_by_side.extract("no-such-ref-" + "0" * 8, tmp_path)


def test_the_ratio_is_read_from_the_ddp_harness_own_table() -> None:
    rounds = [{"base": 1.0, "agent": 1.25, "naive": 2.0, "pyhook": 1.1, "floor": 1.2}] * 3
    pairs = [{"agent": 1.0, "scrape": 1.05}] * 2
    args = argparse.Namespace(rounds=3, scrape_pairs=2, block=1, d_model=8, layers=1, batch=1,
                              seq=4, threads=1)
    printed = overhead.summarize({"rounds": rounds, "pairs": pairs, "params": 1e6,
                                  "renders": 0}, args)
    assert side_by_side.table_ratio(printed, "agent / base") == 1.25
    assert side_by_side.table_ratio(printed, "agent / floor") == pytest.approx(1.042, abs=1e-3)
    with pytest.raises(RuntimeError, match="no row"):
        side_by_side.table_ratio(printed, "zero2")


def test_host_cost_row_and_per_round_ratios() -> None:
    row = "| training-thread CPU | 1021 us | 1362 us | **341 us** (135-517) |"
    assert side_by_side.host_cost_figures(f"text\n{row}\n") == (1021, 1362, 341)
    with pytest.raises(RuntimeError):
        side_by_side.host_cost_figures("| wall | 1 us | 2 us | **1 us** (0-2) |")
    assert side_by_side.per_round([2.0, 3.0, 1.0], [1.0, 2.0, 0.0]) == [2.0, 1.5]
    assert side_by_side.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)


def test_the_bootstrap_interval_holds_a_known_shift() -> None:
    import slow_stuck_cost  # benchmarks/: imports torch and ddpmon, only this test needs it

    gen = torch.Generator().manual_seed(3)
    off = 1e-3 + 2e-4 * torch.rand(2000, generator=gen, dtype=torch.float64)
    noise = 4e-5 * (torch.rand(2000, generator=gen, dtype=torch.float64) - 0.5)
    cases = ((slow_stuck_cost.paired_median, off + 5e-6 + noise),  # +5 us, each pair +-20 us
             (slow_stuck_cost.low_quantile, off + 5e-6))  # every step 5 us longer
    for estimator, on in cases:
        mid, lo, hi = slow_stuck_cost.bootstrap(on.tolist(), off.tolist(), estimator,
                                                resamples=100)
        assert lo <= mid <= hi
        assert abs(mid - 5e-6) <= max(hi - lo, 1e-12)  # the shift, to within the interval's width
        assert hi - lo < 5e-6  # 2,000 pairs resolve a shift this size
