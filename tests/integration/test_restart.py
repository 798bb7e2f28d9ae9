"""Recovery proven on real runs: ``ddpmon demo`` under torchrun (2 gloo ranks, 60 steps,
checkpoints every 10), rank 1 SIGKILLed at step 35, torchrun restarts both ranks, they resume
from step 30 and reach step 60. The timeline shows both attempts and the 5 steps lost;
``ddpmon compare`` finds the resumed run equal to an uninterrupted one. A resume that leaves the
optimizer state out diverges right after step 30, and ddpmon names the missing state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.ports import free_port_pair

pytest.importorskip("pyarrow")  # ddpmon compare reads the numerics history

ENV = {"PATH": "/usr/bin:/bin", "COLUMNS": "200"}


def demo(run_dir: Path, run_id: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "ddpmon.cli", "demo", "--nproc", "2", "--steps", str(steps),
        "--step-delay", "0", "--port", str(free_port_pair()), "--run-dir", str(run_dir),
        "--run-id", run_id, "--sd-dir", "none", "--no-progress", "--checkpoint-every", "10",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and str(run_dir / run_id) in " ".join(p.info["cmdline"])]
    assert not leftovers, leftovers
    return proc


def cli_json(*args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", *args, "--json"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("restart")
    demo(d, "clean", 60)
    return d / "clean"


def test_sigkill_at_35_restarts_from_30_and_matches_an_uninterrupted_run(baseline):
    run_dir = baseline.parent
    demo(run_dir, "killed", 60, "--resume", "--max-restarts", "1",
         "--inject", "kill@rank1:step35")
    run = run_dir / "killed"

    code, tl = cli_json("timeline", str(run))
    assert code == 0
    ff = tl["first_failure"]
    assert (ff["rank"], ff["kind"], ff["attempt"]) == (1, "vanished", 0)
    assert [a["attempt"] for a in tl["attempts"]] == [0, 1]
    assert [a["last_step"] for a in tl["attempts"]] == [34, 59]
    assert tl["attempts"][1]["t_rel_start"] > tl["attempts"][0]["t_rel_end"]  # one clock
    assert tl["last_good_checkpoint"]["step"] == 30
    assert tl["steps_lost"] == 5
    resumed = tl["restarted"]["resumed_from"]
    assert resumed["step"] == 30 and resumed["missing"] == []
    assert {e["attempt"] for e in tl["events"] if e["rank"] == 1 and e["kind"] == "start"} == {0, 1}

    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["attempt"] == 1 and manifest["recovery"]["resume_step"] == 30
    assert manifest["recovery"]["restored"] == ["model", "optimizer", "scaler", "rng",
                                                "data_loader"]
    assert [a["attempt"] for a in manifest["previous_attempts"]] == [0]

    # ddpmon compare: every gradient-norm series (global, per group), the loss scale and the
    # skipped steps are equal at all 60 steps. The loss series is left out: rank 1's history
    # loses its last ~1 s of rows to the SIGKILL (steps before 30 that no attempt rewrote), and
    # compare then averages step losses over one rank instead of two.
    code, cmp = cli_json("compare", str(baseline), str(run))
    # Steps 30-59 are rewritten by attempt 1, so they are always common. Before 30, each rank
    # keeps only what its history had journaled (every flush_seconds=1 s) when the SIGKILL (rank
    # 1) or torchrun's SIGTERM (rank 0) landed: with --step-delay 0 the 35 steps can take less
    # than that first second, so anything from none to all of steps 0-29 is common, and compare
    # keeps only steps that every rank of both runs has. What it compares must all be equal.
    assert cmp["comparable"] and 30 <= cmp["common_steps"] <= 60, cmp
    series = {s["name"]: s for s in cmp["series"]}
    assert {"grad_norm", "loss_scale", "skipped"} <= set(series)
    assert any(name.startswith("group:") for name in series)
    assert [n for n, s in series.items() if n != "loss" and s["first_step"] is not None] == []
    # Where both runs ended: each rank's last loss and gradient norm, bit for bit.
    for rank in (0, 1):
        a = json.loads((baseline / f"summary.rank{rank}.json").read_text())
        b = json.loads((run / f"summary.rank{rank}.json").read_text())
        assert (b["last_step"], b["loss"], b["grad_norm"]) == (59, a["loss"], a["grad_norm"])


def test_resume_without_optimizer_state_diverges_and_names_it(baseline):
    """A second launch under the same run id (no torchelastic restart: the run dir counts the
    attempt) that resumes at 30 without the optimizer state."""
    run_dir = baseline.parent
    demo(run_dir, "partial", 30)
    demo(run_dir, "partial", 60, "--resume", "--resume-without", "optimizer")
    run = run_dir / "partial"

    code, tl = cli_json("timeline", str(run))
    assert code == 0 and tl["first_failure"] is None
    (first, second) = tl["attempts"]
    assert first["source"] == "torchelastic"  # restart count 0, no earlier start
    assert second["source"] == "run_dir"  # restart count 0 again, one earlier start
    assert second["resumed_from"]["step"] == 30
    assert second["resumed_from"]["missing"] == ["optimizer"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["recovery"]["not_restored"] == ["optimizer"]

    code, cmp = cli_json("compare", str(baseline), str(run))
    # step 30 starts from the restored weights (same gradients); its update, made with a fresh
    # optimizer, is the first to differ: step 30 is sampled (every 10 steps), so its update
    # ratio names it; the loss and norms follow from step 31
    assert cmp["diverged"] and cmp["first_divergent_step"] == 30, cmp
    assert any(s.startswith("ratio:") for s in cmp["first_divergent_series"]), cmp
