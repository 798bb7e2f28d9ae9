"""Real jobs through the daemon: the 2-rank demo under torchrun with the agent, a SIGSEGV
injection, and a daemon restart in the middle of a job (re-adoption and LOST)."""

from __future__ import annotations

import os
import signal
import time

import psutil

from .conftest import Daemon

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "LOST"}
DEMO = ["--steps", "16", "--step-delay", "0.3"]


def _sd_ranks(daemon: Daemon, job_id: str) -> set[str]:
    return {
        g["labels"]["rank"] for g in daemon.get("/sd").json() if g["labels"].get("job_id") == job_id
    }


def test_demo_completes_with_metrics_and_segv_fails_on_rank1(daemon: Daemon) -> None:
    assert daemon.submit("ok", "demo", 2, DEMO).status_code == 201
    segv = [*DEMO, "--inject", "segv@rank1:step5"]
    assert daemon.submit("segv", "demo", 2, segv).status_code == 201

    seen_sd: set[str] = set()
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        jobs = {j: daemon.job(j) for j in ("ok", "segv")}
        if jobs["ok"]["state"] == "RUNNING":
            seen_sd |= _sd_ranks(daemon, "ok")
        if all(j["state"] in FINAL for j in jobs.values()):
            break
        time.sleep(0.25)
    ok, bad = jobs["ok"], jobs["segv"]

    assert ok["state"] == "COMPLETED", ok
    assert seen_sd == {"0", "1"}, "both ranks should be listed by /sd while running"
    assert _sd_ranks(daemon, "ok") == set()
    assert {r: s["exit_code"] for r, s in ok["ranks"].items()} == {"0": 0, "1": 0}
    summary = ok["summary"]
    assert summary["scrapes_ok"] > 0 and summary["max_step"] == 15, summary
    assert {"loss", "grad_norm", "loss_scale"} <= set(summary["ranks"]["0"])

    assert bad["state"] == "FAILED", bad
    first = bad["first_failure"]
    assert (first["rank"], first["signal"]) == (1, signal.SIGSEGV), bad["failures"]
    assert bad["ranks"]["1"]["signal"] == signal.SIGSEGV
    assert "rank 1" in bad["reason"] and "signal 11" in bad["reason"]
    assert bad["verdict"]["layer"] == "process", bad["verdict"]  # as `ddpmon timeline` ends
    assert bad["verdict"]["line"].startswith("process (SIGSEGV on rank 1"), bad["verdict"]
    assert ok["verdict"] is None
    assert _sd_ranks(daemon, "segv") == set()
    # per-rank output kept
    log = daemon.get("/api/v1/jobs/ok/logs", params={"rank": 1, "stream": "stderr"})
    assert log.status_code == 200


def test_restart_mid_job_readopts_or_marks_lost(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    # 40 steps of 0.3 s and the agents' 6 s linger: the restart below has about 15 s to
    # re-adopt the job and scrape it again before its ranks are gone (a loaded machine needs it).
    assert daemon.submit("long", "demo", 2, ["--steps", "40", "--step-delay", "0.3",
                                              ]).status_code == 201  # fmt: skip
    assert daemon.submit("doomed", "sleeper", 1, ["120"]).status_code == 201
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # mid-job: both ranks answering /metrics
        long_job = daemon.job("long")
        if long_job["summary"].get("ranks_up") == 2:
            break
        assert long_job["state"] == "RUNNING", long_job
        time.sleep(0.25)
    else:
        raise AssertionError(f"demo ranks never came up: {long_job}")
    doomed = daemon.wait("doomed", {"RUNNING"})

    daemon.stop()
    launcher = psutil.Process(long_job["pid"])
    assert launcher.is_running(), "jobs must survive a daemon stop"
    # While the daemon is down, the other job dies without leaving a result.
    victim = psutil.Process(doomed["pid"])
    family = [victim, *victim.children(recursive=True)]
    for p in family:
        os.kill(p.pid, signal.SIGKILL)
    psutil.wait_procs(family, timeout=10)

    daemon.start()
    again = daemon.job("long")
    assert again["state"] == "RUNNING" and again["id"] == "long", again
    assert again["created_at"] == long_job["created_at"]
    lost = daemon.job("doomed")
    assert lost["state"] == "LOST", lost
    assert "while the daemon was not running" in lost["reason"]

    done = daemon.wait("long", FINAL, timeout=120)
    assert done["state"] == "COMPLETED", done
    assert {r: s["exit_code"] for r, s in done["ranks"].items()} == {"0": 0, "1": 0}
    assert done["summary"]["max_step"] == 39, done["summary"]
