"""Readers pointed at a hostile run dir neither hang, nor exhaust memory, nor crash: a FIFO in
place of an events file, a line nested past the parser's recursion and a 2 GB sparse file are
each reported as damage, and the rest of the run is still read. Run as an operator would:
``ddpmon timeline`` in a subprocess, under an address-space limit well below the file's size
and a time limit (a reader that opened the FIFO blocking would never return)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
from ddpmon.cli import main
sys.exit(main(sys.argv[1:]))
"""


def hostile_run(root: Path) -> Path:
    run = root / "run-1"
    run.mkdir(parents=True)
    with open(run / "events.rank0.jsonl", "w") as fh:
        fh.write(json.dumps({"ts": 1000.0, "rank": 0, "step": None, "kind": "start",
                             "clock_offset_seconds": 0.0, "world_size": 2}) + "\n")
        fh.write("[" * 100_000 + "]" * 100_000 + "\n")  # RecursionError in json.loads
        fh.write(json.dumps({"ts": 1001.0, "rank": 0, "step": 3, "kind": "nonfinite",
                             "param": "w", "origin": True, "nonfinite": "nan"}) + "\n")
    os.mkfifo(run / "events.rank1.jsonl")  # opened blocking, it would never return
    with open(run / "progress.rank0.json", "wb") as fh:
        fh.truncate(2 << 30)  # 2 GB of holes: read whole, it would not fit under the limit
    return run


def reader(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LIMIT, *argv], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )


@pytest.mark.parametrize("command", [["timeline"], ["timeline", "--json"]])
def test_timeline_reports_the_damage_and_reads_the_rest(tmp_path, command):
    run = hostile_run(tmp_path)
    done = reader(*command, str(run))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 3), done.stdout + done.stderr  # 3: a rank is missing
    assert "events.rank1.jsonl: unreadable" in done.stderr and "regular file" in done.stderr
    assert "events.rank0.jsonl: 1 of 3 lines unreadable" in done.stderr, done.stderr
    assert "progress.rank0.json: over" in done.stderr, done.stderr
    if "--json" in command:
        ff = json.loads(done.stdout)["first_failure"]
        assert (ff["rank"], ff["step"], ff["param"]) == (0, 3, "w")
    else:
        assert "First failure:" in done.stdout and "param=w" in done.stdout
