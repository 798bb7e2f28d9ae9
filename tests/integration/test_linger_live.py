"""The last values reach the store: a 3-second job scraped every 10 s by a real Prometheus.

Two jobs run side by side against one Prometheus (file_sd, 10 s scrape interval): one with the
agent's default ``linger_seconds``, one with 0. The lingering job's final step and counters are
in the store; the other's are not (the control: without the linger, a scrape would have had to
land between the final step and close, milliseconds apart), so this test fails if close() stops
waiting for the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.services import Prometheus
from tests.support.ports import free_ports
from tests.support.stack import wait_for

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("linger_worker.py")
SCRAPE_INTERVAL = 10
JOB_SECONDS = 3.0


def _start_job(tmp_path: Path, run_id: str, port: int, linger: float | None) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--run-id", run_id, "--port", str(port),
           "--sd-dir", str(tmp_path / "sd"), "--run-dir", str(tmp_path / "runs"),
           "--seconds", str(JOB_SECONDS)]
    if linger is not None:
        cmd += ["--linger", str(linger)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    env.pop("DDPMON_LINGER_SECONDS", None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _stored(prom: Prometheus, name: str, run: str) -> float | None:
    """The newest sample of ``name`` for ``run`` in the last 2 minutes (the series went stale
    when the rank removed its target, so an instant query at "now" would not see it)."""
    result = prom.query(f'last_over_time({name}{{run="{run}"}}[2m])')
    return float(result[0]["value"][1]) if result else None


def test_short_job_final_step_reaches_the_store(tmp_path):
    (tmp_path / "sd").mkdir()
    prom = Prometheus(tmp_path / "prom", sd_dir=tmp_path / "sd",
                      scrape_interval=f"{SCRAPE_INTERVAL}s", port=free_ports(1))
    prom.start()
    try:
        base = free_ports(2)
        jobs = {
            "lingers": _start_job(tmp_path, "lingers", base, None),
            "nolinger": _start_job(tmp_path, "nolinger", base + 1, 0.0),
        }
        out = {}
        for run, proc in jobs.items():
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr
            out[run] = json.loads(stdout.strip().splitlines()[-1])
        lingers, control = out["lingers"], out["nolinger"]
        # The job ended before its first scrape could be relied on; close() waited for it, no
        # longer than the linger bound.
        assert lingers["lingered"] == "scraped", lingers
        assert lingers["close_seconds"] <= lingers["linger_seconds"] + 2, lingers
        assert control["lingered"] == "no-wait" and control["close_seconds"] < 2, control

        def final(run: str) -> dict[str, float | None]:
            return {
                "ddpmon_steps_total": _stored(prom, "ddpmon_steps_total", run),
                "ddpmon_step": _stored(prom, "ddpmon_step", run),
                "ddpmon_step_duration_seconds_count": _stored(
                    prom, "ddpmon_step_duration_seconds_count", run),
            }

        expected = {
            "ddpmon_steps_total": lingers["steps_total"],
            "ddpmon_step": lingers["step"],
            "ddpmon_step_duration_seconds_count": lingers["steps_total"],
        }
        assert lingers["steps_total"] > 10  # a real few-second job, not an empty one
        got = wait_for(lambda: final("lingers") == expected and final("lingers"), timeout=5,
                       what="the lingering job's final values in Prometheus")
        assert got == expected
        # The control's final step never reached the store.
        stored = final("nolinger")["ddpmon_steps_total"]
        assert stored is None or stored < control["steps_total"], (stored, control)
    finally:
        prom.stop()
