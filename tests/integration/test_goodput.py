"""Goodput as the job lived it: 4 gloo ranks under ``torchrun --max-restarts 3``, checkpoints
every 10 steps, three failures (a SIGKILL at step 25, a raised NaN at step 37, a hang at step 48
ended by the collective timeout after the stall watchdog saw it) and a last attempt that
finishes 60 steps. The worker (``goodput_worker.py``) writes its own clock of every step and of
its birth; ``ddpmon timeline --json`` must agree with it:

- the buckets add up to the wall-clock time, and that time is the worker's own (first birth to
  last exit) within 1 %;
- progress lost is the steps computed again (20: 5 + 7 + 8) times their own step time, within 5 %;
- productive time (plus the warm-up carved out of kept steps) is the kept steps times their own
  step time, within 2 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ports import free_ports

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/bin:/bin", "COLUMNS": "200", "PYTHONPATH": str(ROOT),
       "OMP_NUM_THREADS": "1"}
RESUMED_FROM = {1: 20, 2: 30, 3: 40}
LOST_FROM = {0: 20, 1: 30, 2: 40}
"""Each attempt's steps from here on were computed again by the next attempt."""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("goodput")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_ports()}", "--max-restarts=3",
           "--monitor-interval=0.5", str(ROOT / "tests/integration/goodput_worker.py"),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def truth(out: Path) -> dict:
    """The worker's own account: wall-clock time, kept and lost step time (mean over ranks; a
    step's length on its monotonic clock, which a step of the system time does not move)."""
    born, done, kept, lost, counts = [], [], [], [], []
    for rank in range(4):
        lines = [json.loads(x) for x in (out / f"truth.rank{rank}.jsonl").read_text().splitlines()]
        born += [x["t"] for x in lines if x["kind"] == "born"]
        done += [x["t"] for x in lines if x["kind"] == "done"]
        steps = [x for x in lines if x["kind"] == "step"]
        is_lost = [x["step"] >= LOST_FROM.get(x["attempt"], 1 << 30) for x in steps]
        took = [(x["took"], gone) for x, gone in zip(steps, is_lost, strict=True)]
        kept.append(sum(t for t, gone in took if not gone))
        lost.append(sum(t for t, gone in took if gone))
        counts.append((sum(not g for g in is_lost), sum(is_lost)))
    return {"wall": max(done) - min(born), "kept": sum(kept) / 4, "lost": sum(lost) / 4,
            "counts": counts}


def truth_gaps(out: Path) -> dict[int, float]:
    """attempt -> from its last completed step on any rank to the next attempt's first birth,
    by the worker's own clock."""
    ends: dict[int, float] = {}
    born: dict[int, float] = {}
    for rank in range(4):
        for x in (json.loads(line) for line in
                  (out / f"truth.rank{rank}.jsonl").read_text().splitlines()):
            a = x["attempt"]
            if x["kind"] == "step":
                ends[a] = max(ends.get(a, x["end"]), x["end"])
            elif x["kind"] == "born":
                born[a] = min(born.get(a, x["t"]), x["t"])
    return {a: born[a + 1] - ends[a] for a in ends if a + 1 in born}


def timeline(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpmon.cli", "timeline", "--no-slurm",
                           str(out / "runs" / "gp"), *extra],
                          capture_output=True, text=True, timeout=120, env=ENV)


def test_buckets_add_up_and_match_the_jobs_own_clock(job):
    proc = timeline(job, "--json")
    assert proc.returncode == 0, proc.stderr
    tl = json.loads(proc.stdout)
    g, want = tl["goodput"], truth(job)
    assert [a.get("resumed_from", {}) and a["resumed_from"]["step"]
            for a in tl["attempts"][1:]] == [20, 30, 40]
    assert [a["attempt"] for a in g["attempts"]] == [0, 1, 2, 3]

    total = sum(g["buckets"].values())
    assert total == pytest.approx(g["wall_seconds"], rel=1e-6)
    for a in g["attempts"]:  # each attempt's buckets tile its own span
        assert sum(a["buckets"].values()) == pytest.approx(a["t_rel_end"] - a["t_rel_start"],
                                                           rel=1e-6, abs=1e-6)
    assert g["wall_seconds"] == pytest.approx(want["wall"], rel=0.01)

    b = g["buckets"]
    assert b["wasted_progress_from_disruption"] == pytest.approx(want["lost"], rel=0.05)
    assert b["productive"] + b["program_startup"] == pytest.approx(want["kept"], rel=0.02)
    for rank, r in g["ranks"].items():
        assert (r["kept_steps"], r["lost_steps"]) == want["counts"][int(rank)] == (60, 20)
    assert g["goodput"] == pytest.approx(b["productive"] / g["wall_seconds"], rel=1e-5)
    assert g["goodput"] < g["ettr"] < 1

    per = {a["attempt"]: a["buckets"] for a in g["attempts"]}
    # the hang: from the last step before it to the collective timeout (15 s) is detection
    assert per[2]["failure_detection"] > 10
    gap = truth_gaps(job)
    for a in (0, 1, 2):  # a failure's last step to the next attempt: detection, then the gap
        after = per[a]["failure_detection"] + per[a]["restart_gap"] + per[a]["other"]
        # the worker's birth is noted a Python start after the process's
        assert after == pytest.approx(gap[a], abs=1.0), (a, per[a], gap[a])
        assert per[a]["restart_gap"] >= 0  # torchrun can restart within the birth clock's 10 ms
    assert all(per[a]["unproductive_checkpoint_restore"] > 0 for a in (1, 2, 3))
    assert all(per[a]["initialization"] > 0 for a in (0, 1, 2, 3))
    assert per[3]["wasted_progress_from_disruption"] == 0
    assert b["other"] < 0.01 * g["wall_seconds"]


def test_the_text_view_shows_the_buckets(job):
    proc = timeline(job)
    assert proc.returncode == 0, proc.stderr
    assert "Goodput" in proc.stdout and "ETTR" in proc.stdout
    for name in ("productive", "wasted_progress_from_disruption", "failure_detection",
                 "restart_gap", "attempt 3"):
        assert name in proc.stdout


def test_the_report_draws_one_bar_per_attempt(job, tmp_path):
    page = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", "report", str(job / "runs" / "gp"),
                           "-o", str(page)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    section = text[text.index('id="goodput"'):text.index('id="plot-goodput"') + 200_000]
    figure = section[:section.index("</figure>")]
    for attempt in range(4):
        assert f"attempt {attempt}" in figure
    assert "attempt 4" not in figure
    for bucket in ("productive", "wasted_progress_from_disruption", "restart_gap"):
        assert bucket in figure  # in the legend: each bucket with time is drawn
