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

from ddpmon.forensics.compare import NOISE_STEPS
from tests.support.history import history_column
from tests.support.ports import free_port_pair

pytest.importorskip("pyarrow")

GLOBAL_BATCH = 8


def demo(run_dir: Path, run_id: str, nproc: int, steps: int, *injects: str,
         extra: tuple[str, ...] = ()) -> Path:
    cmd = [
        sys.executable, "-m", "ddpmon.cli", "demo",
        "--nproc", str(nproc), "--steps", str(steps), "--step-delay", "0",
        "--global-batch", str(GLOBAL_BATCH), "--seed", "0",
        "--port", str(free_port_pair()), "--run-dir", str(run_dir), "--run-id", run_id,
        "--sd-dir", "none", "--no-progress",
    ]
    for spec in injects:
        cmd += ["--inject", spec]
    cmd += extra
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
    # The noise is the runs' own difference over the first steps, read here from their history
    # files: 2 ranks sum in another order than 1, which rounds differently on an AVX2 CPU and
    # may be bit-identical on an AVX-512/AMX one, so its size is whatever these two runs made.
    a, b = (history_column(runs[name], 0, "grad_norm") for name in ("one", "two"))
    first = sorted(set(a) & set(b))[:NOISE_STEPS]
    assert len(first) == NOISE_STEPS
    expected = max(abs(a[s] - b[s]) / max(abs(a[s]), abs(b[s])) for s in first)
    assert series["grad_norm"]["noise"] == pytest.approx(expected, rel=1e-9, abs=1e-300)
    assert (series["grad_norm"]["noise"] > 0) == any(a[s] != b[s] for s in first)
    # ... and within the tolerance it sets
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


def test_text_table_fits_80_columns_and_cuts_no_number(runs):
    """A CI log: not a TTY, 80 columns. Every row keeps whole numbers (no "0.00e+…")."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "compare", str(runs["one"]), str(runs["scaled"])],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                           "COLUMNS": "80"},
    )
    _, out = compare(runs["one"], runs["scaled"])
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "\u2026" not in proc.stdout, proc.stdout
    rows = {line.split()[0]: line.split() for line in lines if line.split()
            and line.split()[0] in {s["name"] for s in out["series"]}}
    assert len(rows) == len(out["series"]), proc.stdout
    for s in out["series"]:
        name, noise, tol, before, first, a, b, diff = rows[s["name"]]
        assert float(noise) == pytest.approx(s["noise"], rel=0.06, abs=1e-12)
        assert float(tol) == pytest.approx(s["tolerance"], rel=0.06)
        assert first == ("-" if s["first_step"] is None else str(s["first_step"]))
        if s["value_a"] is not None:
            assert float(a) == pytest.approx(s["value_a"], rel=1e-4)
            assert float(b) == pytest.approx(s["value_b"], rel=1e-4)
            assert float(diff) == pytest.approx(s["rel_diff"], rel=0.06)


def test_the_ranks_and_steps_each_run_rests_on_are_stated(runs, tmp_path):
    code, out = compare(runs["one"], runs["two"])
    assert out["basis"]["a"] == {"ranks_used": 1, "ranks_expected": 1, "ranks": [0],
                                 "steps": 60}
    assert out["basis"]["b"]["ranks"] == [0, 1] and out["basis"]["common_steps"] == 60
    assert not any("rests on" in w for w in out["warnings"])
    # rank 1's history cut short by a crash mid-write: rank 0 is still compared, and it is said
    damaged = tmp_path / "two"
    shutil.copytree(runs["two"], damaged)
    hist = damaged / "history.rank1.arrow"
    hist.write_bytes(hist.read_bytes()[: hist.stat().st_size // 3])
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "compare", str(runs["one"]), str(damaged)],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                           "COLUMNS": "80"},
    )
    assert "B rests on 1 of 2 ranks, 60 steps" in proc.stdout, proc.stdout
    assert "ddpmon compare: warning: run B: history.rank1.arrow: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    code, out = compare(runs["one"], damaged)
    assert out["basis"]["b"]["ranks"] == [0] and out["basis"]["b"]["ranks_expected"] == 2
    assert [d["file"] for d in out["damaged"]] == ["history.rank1.arrow"]
    assert any("run B rests on 1 of 2 ranks" in w for w in out["warnings"])


def test_a_resume_without_optimizer_state_is_named_with_the_divergence(runs, tmp_path):
    resumed = demo(tmp_path, "resumed", 2, 40, "kill@rank1:step30", extra=(
        "--checkpoint-every", "8", "--resume", "--max-restarts", "1",
        "--resume-without", "optimizer"))
    code, out = compare(runs["two"], resumed)
    assert code == 1, out
    (r,) = out["resumes"]["b"]
    assert r["attempt"] == 1 and r["missing"] == ["optimizer"] and out["resumes"]["a"] == []
    step = r["step"]
    # the norms are of gradients before the update: the first resumed update shows one later
    assert out["first_divergent_step"] in (step, step + 1), out
    note = f"B resumed at step {step} without optimizer state; divergence begins at the first " \
        "resumed step"
    assert any(w.startswith(note) for w in out["warnings"]), out["warnings"]


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
    from ddpmon.metrics.state import StepRecord
    from ddpmon.recorder.history import HistoryWriter, row_of

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
