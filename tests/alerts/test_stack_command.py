"""``ddpmon stack`` end to end: shipped configs load, file_sd targets are scraped with their
labels, an alert reaches the built-in printing receiver, and SIGTERM stops everything cleanly."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from ddpmon.export.discovery import FileSDPublisher
from tests.support.contract import CONTRACT_ALERTS
from tests.support.ports import free_port
from tests.support.stack import PrometheusAPI, stop_stack, wait_for

pytestmark = pytest.mark.timeout(120)


class FakeRank(BaseHTTPRequestHandler):
    """Serves a rank whose loss became non-finite once ``nonfinite`` is set."""

    nonfinite = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        body = (
            "# TYPE ddpmon_loss_nonfinite_total counter\n"
            f'ddpmon_loss_nonfinite_total{{run="s1",rank="0"}} {FakeRank.nonfinite}\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_stack_serves_shipped_config_and_stops_on_sigterm(tmp_path: Path) -> None:
    rank = ThreadingHTTPServer(("127.0.0.1", 0), FakeRank)
    threading.Thread(target=rank.serve_forever, daemon=True).start()
    sd_dir = tmp_path / "sd"
    FileSDPublisher(
        sd_dir, target=f"127.0.0.1:{rank.server_address[1]}",
        labels={"run": "s1", "rank": "0", "node": "n", "local_rank": "0"},
        filename="ddpmon-s1-rank0.json",
    ).publish()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpmon.cli", "stack", "--sd-dir", str(sd_dir),
         "--prometheus-port", str(port), "--alertmanager-port", "0", "--scrape-interval", "1s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    try:
        wait_for(lambda: any("Ctrl-C stops" in x for x in lines), 60, what="stack ready")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 2  # prometheus and alertmanager
        prom = PrometheusAPI(f"http://127.0.0.1:{port}")
        groups = prom.api("rules")["groups"]
        kinds = [r["type"] for g in groups for r in g["rules"]]
        assert kinds.count("alerting") == len(CONTRACT_ALERTS) and kinds.count("recording") >= 19
        up = wait_for(lambda: prom.query('up{job="ddpmon"} == 1'), 30, what="target scraped")
        assert up[0]["metric"]["run"] == "s1" and up[0]["metric"]["node"] == "n"
        FakeRank.nonfinite = 1
        # Shipped critical route: group_wait 10s, then the stack's receiver prints it.
        wait_for(
            lambda: any("FIRING DdpmonNonFiniteLoss (critical) Rank 0 of run s1" in x
                        for x in lines),
            60, what="alert printed by the stack",
        )
    finally:
        try:
            code = stop_stack(proc, reader)
        finally:
            rank.shutdown()
    assert code == 0, lines
    assert "stack stopped" in lines[-1]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
    data_dir = next(x for x in lines if x.startswith("data")).split()[1]
    assert not Path(data_dir).exists()
