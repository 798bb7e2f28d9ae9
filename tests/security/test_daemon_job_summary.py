"""The daemon's job summary reads ranks that serve TLS + basic auth with the daemon config's
``scrape_config``: a real agent endpoint, a real job manager poll, the store read back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_scrape_client import agent, scrape_yml  # noqa: F401 - the module's agent fixture

from ddpmon.daemon.jobs import JobManager
from ddpmon.daemon.processes import JobProcesses
from ddpmon.daemon.settings import DaemonSettings
from ddpmon.daemon.store import JobRecord, Store


def poll_summary(tmp_path: Path, settings: DaemonSettings, port: int) -> dict:
    store = Store(tmp_path / "jobs.sqlite3")
    jobs = JobManager(store, settings, tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.insert_job(JobRecord(id="j1", entrypoint="demo", nproc=1, state="RUNNING",
                                 ports=[port], pid=launcher.pid))
        jobs._active["j1"] = JobProcesses("j1", popen=launcher)
        jobs.poll_once()
        assert jobs.scrapes_settled(10)  # summaries are scraped off the watcher thread
        job = store.get_job("j1")
        assert job is not None
        return job.summary
    finally:
        launcher.kill()
        launcher.wait()
        store.close()


def test_job_summary_uses_the_configured_scrape_client(agent, pki, tmp_path):  # noqa: F811
    cfg = DaemonSettings.from_dict(
        {"scrape_config": str(scrape_yml(tmp_path, ca=pki.ca))}, base_dir=tmp_path)
    summary = poll_summary(tmp_path / "a", cfg, agent.port)
    assert summary["ranks_up"] == 1 and summary["ranks"]["0"]["up"] is True, summary
    assert summary["ranks"]["0"]["step"] == 2 and "scrape_errors" not in summary
    # Without the scrape config the same rank cannot be read, and the summary says why.
    plain = poll_summary(tmp_path / "b", DaemonSettings(), agent.port)
    assert plain["ranks_up"] == 0 and "https" in plain["scrape_errors"]["0"], plain
