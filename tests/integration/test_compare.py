"""`ddpmon compare` on real demo runs (torchrun, gloo): a 1-rank baseline against 2-rank runs
with the same global batch and seed, clean and with injected numerics bugs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.demo import free_port_pair

pytest.importorskip("pyarrow")

GLOBAL_BATCH = 8


def demo(run_dir: Path, run_id: str, nproc: int, steps: int, *injects: str) -> Path:
    cmd = [
        sys.executable, "-m", "ddpmon.cli", "demo",
        "--nproc", str(nproc), "--steps", str(steps), "--step-delay", "0",
        "--global-batch", str(GLOBAL_BATCH), "--seed", "0",
        "--port", str(free_port_pair()), "--run-dir", str(run_dir), "--run-id", run_id,
        "--sd-dir", "none", "--no-progress",
    ]
    for spec in injects:
        cmd += ["--inject", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir / run_id


def compare(a: Path, b: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "compare", str(a), str(b), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("compare")
    return {
        "one": demo(d, "one", 1, 60),
        "two": demo(d, "two", 2, 60),
        "scaled": demo(d, "scaled", 2, 30, "grad-scale@rank1:step20"),
        "dup": demo(d, "dup", 2, 12, "dup-data@rank1:step0"),
    }


def test_one_rank_and_two_ranks_agree_over_60_steps(runs):
    code, out = compare(runs["one"], runs["two"])
    assert code == 0, out
    assert out["comparable"] and not out["diverged"] and out["common_steps"] == 60
    assert out["facts"]["a"]["world_size"] == 1 and out["facts"]["b"]["world_size"] == 2
    assert out["facts"]["b"]["global_batch"] == GLOBAL_BATCH
    assert out["facts"]["b"]["micro_batch"] == GLOBAL_BATCH // 2
    series = {s["name"]: s for s in out["series"]}
    # the runs are not bit-identical (reduction order), yet within the measured tolerance
    assert series["grad_norm"]["noise"] > 0
    assert all(s["first_step"] is None for s in series.values())
    groups = [n for n in series if n.startswith("group:")]
    assert groups, series


def test_gradients_scaled_on_rank1_diverge_at_step_20_with_a_group_named(runs):
    code, out = compare(runs["one"], runs["scaled"])
    assert code == 1, out
    assert out["first_divergent_step"] == 20
    group = out["first_divergent_group"]
    assert group and f"group:{group}" in out["first_divergent_series"]
    assert group in out["facts"]["a"]["group_names"]
    series = {s["name"]: s for s in out["series"]}
    assert series["grad_norm"]["first_step"] == 20
    assert series["grad_norm"]["rel_diff"] > 10 * series["grad_norm"]["tolerance"]
    assert series["loss"]["first_step"] in (None, 21)  # the loss moves only after the update


def test_duplicated_data_shard_is_reported_divergent(runs):
    code, out = compare(runs["one"], runs["dup"])
    assert code == 1, out
    assert out["first_divergent_step"] == 0
    assert out["first_divergent_group"]


def test_text_output_has_the_per_group_table(runs):
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "compare", str(runs["one"]), str(runs["scaled"])],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                           "COLUMNS": "160"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "First divergence: step 20 in group" in proc.stdout
    for name in ("group:embed", "group:encoder", "group:head", "tolerance"):
        assert name in proc.stdout


def test_different_seed_is_not_comparable(runs, tmp_path):
    other = tmp_path / "seed1"
    shutil.copytree(runs["two"], other)
    ann = json.loads((other / "annotations.json").read_text())
    (other / "annotations.json").write_text(json.dumps({**ann, "seed": 1}))
    code, out = compare(runs["one"], other)
    assert code == 3
    assert not out["comparable"] and any("seed differs" in r for r in out["reasons"])


def test_a_directory_without_history_is_a_clear_error(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    code, out = compare(tmp_path, tmp_path)
    assert code == 2 and "no numerics history" in out["error"]


# -- the tolerance rule on synthetic histories (fast; the same reader and comparison code) ----


def synthetic(path: Path, factor_from: dict[int, float], noise: float, seed: int,
              group_b_nan_at: int | None = None) -> Path:
    from ddpmon.forensics.history import HistoryWriter, row_of
    from ddpmon.state import StepRecord

    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    w = HistoryWriter(path / "history.rank0.arrow", ("a", "b"), flush_seconds=0.01)
    for s in range(50):
        jitter = 1 + noise * rng.standard_normal(3)
        b = 2.0 * jitter[2] * next((f for k, f in sorted(factor_from.items()) if s >= k), 1.0)
        if s == group_b_nan_at:
            b = float("nan")
        a = 1.0 * jitter[1]
        w.put(row_of(StepRecord(step=s, wall_time=float(s), duration_seconds=0.1,
                                data_wait_seconds=0.0, loss=3.0 * jitter[0],
                                grad_norm=float(np.hypot(a, b)), group_norms={"a": a, "b": b},
                                loss_scale=1024.0), ("a", "b"), None))
    w.close()
    return path


def test_tolerance_comes_from_the_first_steps_noise(tmp_path):
    from ddpmon.forensics.compare import NOISE_FACTOR, compare_runs

    a = synthetic(tmp_path / "a", {}, 1e-6, 0)
    b = synthetic(tmp_path / "b", {30: 1.5}, 1e-6, 1)  # group b x1.5 from step 30
    c = compare_runs(a, b)
    assert c.first_step == 30 and c.first_group == "b"
    s = {r.name: r for r in c.series}
    assert s["group:a"].first_step is None  # group a untouched
    assert s["group:b"].tolerance == pytest.approx(max(1e-3, NOISE_FACTOR * s["group:b"].noise))
    assert 0 < s["group:b"].noise < 1e-5


def test_differences_above_the_cap_from_step_0_are_divergence_not_noise(tmp_path):
    from ddpmon.forensics.compare import TOL_CAP, compare_runs

    a = synthetic(tmp_path / "a", {}, 1e-6, 0)
    b = synthetic(tmp_path / "b", {0: 1.2}, 1e-6, 1)
    c = compare_runs(a, b)
    assert c.first_step == 0 and c.first_group == "b"
    assert {r.name: r for r in c.series}["group:b"].tolerance == TOL_CAP


def test_a_nan_in_one_run_only_diverges(tmp_path):
    from ddpmon.forensics.compare import compare_runs

    a = synthetic(tmp_path / "a", {}, 1e-6, 0)
    b = synthetic(tmp_path / "b", {}, 1e-6, 1, group_b_nan_at=12)
    c = compare_runs(a, b)
    assert c.first_step == 12 and c.first_group == "b"
    assert "grad_norm" in c.first_series
