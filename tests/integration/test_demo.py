"""`ddpmon demo` end to end: torchrun, 2 gloo ranks, injected NaN, summary, no leftovers."""

import subprocess
import sys

import psutil

from tests.support.demo import free_port_pair


def test_demo_runs_reports_the_origin_rank_and_leaves_no_process(tmp_path):
    run_id = "demo-test"
    port = free_port_pair()
    cmd = [
        sys.executable,
        "-m",
        "ddpmon.cli",
        "demo",
        "--nproc",
        "2",
        "--steps",
        "12",
        "--step-delay",
        "0",
        "--port",
        str(port),
        "--run-dir",
        str(tmp_path),
        "--run-id",
        run_id,
        "--inject",
        "nan@rank1:step5",
        "--no-progress",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port + 1}/metrics" in out
    assert "per-rank summary" in out
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    rank1 = [r for r in rows if r.split("│")[1].strip() == "1"]
    assert rank1 and "step 5" in rank1[0] and "(nan)" in rank1[0]
    rank0 = [r for r in rows if r.split("│")[1].strip() == "0"]
    assert rank0 and "step 5" not in rank0[0]
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and run_id in " ".join(p.info["cmdline"])
    ]
    assert not leftovers, leftovers


def test_demo_rejects_a_bad_fault_spec_before_starting(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpmon.cli",
            "demo",
            "--inject",
            "boom@rank1:step2",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown fault 'boom'" in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())
