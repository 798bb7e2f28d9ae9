"""`ddpmon demo` end to end: torchrun, 2 gloo ranks, injected NaN, summary, no leftovers."""

import shlex
import subprocess
import sys

import psutil

from tests.support.ports import free_port_pair


def test_demo_runs_reports_the_origin_rank_and_leaves_no_process(tmp_path):
    """Run as CI runs it: no terminal, 80 columns. The output must stay readable there (no cut
    numbers, no table glued to the next one) and end with commands that work on this run."""
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
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port + 1}/metrics" in out
    lines = proc.stdout.splitlines()
    tables = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert tables and max(len(line) for line in tables) <= 80, out  # commands may be longer
    assert "…" not in proc.stdout, out
    assert any(line.strip().startswith("per-rank summary") for line in lines), out
    assert any(line.strip().startswith("live (scraped") for line in lines), out
    origins = [line for line in lines if line.startswith("NaN origin:")]
    assert len(origins) == 1 and origins[0].startswith("NaN origin: rank 1, step 5, "), out
    assert origins[0].endswith("(nan)"), out
    rows = [line for line in lines if line.startswith("│")]
    summary = [r.split("│")[1:5] for r in rows[-2:]]
    assert [c[0].strip() for c in summary] == ["0", "1"], out
    assert summary[0][3].strip() == "-" and summary[1][3].strip() == "5", out
    # The last lines name the next commands for this run, and they run.
    nxt = lines[lines.index("Next, for this run:") + 1 :]
    commands = [line.strip() for line in nxt if line.startswith("  ddpmon ")]
    names = [shlex.split(c)[1] for c in commands]
    assert names == ["timeline", "report", "top", "stack"], out
    run_path = tmp_path / run_id
    assert commands[0] == f"ddpmon timeline {run_path}"
    for command in commands[:2]:
        done = subprocess.run(
            [sys.executable, "-m", "ddpmon.cli", *shlex.split(command)[1:]],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert (run_path / "report.html").stat().st_size > 0
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
