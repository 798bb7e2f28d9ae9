"""SIGTERM writes the rank's last records before the process dies of it (``recorder/
term_flush.py``), in the cases the plain exit-path test (``test_exit_paths``, a SIGTERM while
Python runs) does not reach: the training thread inside a C++ collective, a second SIGTERM, a
flush that never ends, a forked child, a program with its own handler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.recorder.history_read import read_history
from ddpmon.recorder.live_step import dumps
from tests.support.ports import free_port
from tests.support.ranks import rank_env

WORKER = Path(__file__).with_name("sigterm_worker.py")


def start(out: Path, mode: str, world: int = 1) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--out", str(out), "--mode", mode],
            env=rank_env(rank, world, port, None), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]


def wait_ready(out: Path, procs: list[subprocess.Popen], timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while not (out / "ready").exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"exited {p.returncode} before ready: {p.stderr.read()}")
        assert time.monotonic() < end, "never ready"
        time.sleep(0.05)
    return json.loads((out / "result.json").read_text())


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def test_a_rank_inside_a_collective_flushes_and_dies_of_sigterm_at_once(tmp_path, procs):
    procs += start(tmp_path, "blocked", world=2)
    assert wait_ready(tmp_path, procs) == {"steps": 5}
    time.sleep(0.3)  # rank 0 is inside the barrier its peer never joins (120 s timeout)
    rank0 = procs[0]
    t0 = time.monotonic()
    rank0.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    rank0.send_signal(signal.SIGTERM)  # a launcher's second SIGTERM: no second dump
    rank0.wait(30)
    took = time.monotonic() - t0
    assert rank0.returncode == -signal.SIGTERM, rank0.stderr.read()
    assert took < 10, took  # not the barrier's 120 s timeout: Python never ran on that thread
    run = tmp_path / "runs" / "blocked"
    history = read_history(run / "history.rank0.arrow")
    assert [int(s) for s in history.columns["step"]] == [0, 1, 2, 3, 4]
    found = dumps((run / "sigterm.rank0.txt").read_text())
    assert len(found) == 1, found
    assert "barrier" in found[0][1]  # the stacks at the signal: where the rank waited


def test_a_flush_that_never_ends_is_cut_at_its_deadline(tmp_path, procs):
    procs += start(tmp_path, "stuck")
    wait_ready(tmp_path, procs)
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(30)
    assert procs[0].returncode == -signal.SIGTERM, procs[0].stderr.read()
    assert time.monotonic() - t0 < 5  # deadline 0.5 s; the flush sleeps 60 s


def test_a_forked_child_dies_of_sigterm_alone(tmp_path, procs):
    procs += start(tmp_path, "fork")
    procs[0].wait(120)
    assert procs[0].returncode == 0, procs[0].stderr.read()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"child_signal": signal.SIGTERM, "child_code": None, "steps": 6}
    run = tmp_path / "runs" / "fork"
    assert not (run / "sigterm.rank0.txt").exists()  # the child's stack is not the rank's
    history = read_history(run / "history.rank0.arrow")
    assert [int(s) for s in history.columns["step"]] == list(range(6))


def test_a_program_that_handles_sigterm_keeps_its_handler(tmp_path, procs):
    procs += start(tmp_path, "own")
    assert wait_ready(tmp_path, procs) == {"installed": False}
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(30)
    assert procs[0].returncode == 3


def test_a_handler_set_after_attach_owns_sigterm(tmp_path, procs):
    """The wakeup fd is written for every handled signal, and a handler set later may call the
    one it replaced (Lightning's does): neither may act for the program's own handler (a flag;
    the loop exits 3 on its own half a second later)."""
    procs += start(tmp_path, "later")
    wait_ready(tmp_path, procs)
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(30)
    assert procs[0].returncode == 3, procs[0].stderr.read()
