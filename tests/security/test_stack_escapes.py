"""Terminal escapes through ``ddpmon stack`` and ``scaleout`` (issue 51, finding 4) and the
stack's Prometheus lifecycle API (finding 10). Any local user can POST an alert to the stack's
Alertmanager; its labels and annotations (or a run id rendered through ``{{ $labels.run }}``)
carry OSC 52 (a clipboard write) and CSI 2J (a screen clear). The real stack prints them spelled
out, never raw; its Prometheus refuses ``POST /-/quit`` and keeps running. ``scaleout``'s
receiver and final printout clean the same alerts (real HTTP into its receiver)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest

from ddpmon.commands.scaleout import _Receiver, pages_summary
from tests.support.ports import free_port
from tests.support.stack import stop_stack, wait_for

pytestmark = pytest.mark.timeout(150)

OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"
CLEAR = "\x1b[2J\x1b[H"
EVIL = {
    "labels": {"alertname": f"Evil{OSC52}", "severity": "critical", "run": f"r{CLEAR}"},
    "annotations": {"description": f"{CLEAR}see \x1b]8;;http://x\x07here\x1b]8;;\x07 \u202eok"},
}


def post(url: str, body: object) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_stack_prints_alerts_cleaned_and_refuses_quit(tmp_path):
    prom_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpmon.cli", "stack", "--sd-dir", str(tmp_path / "sd"),
         "--prometheus-port", str(prom_port), "--alertmanager-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    raw: list[bytes] = []
    reader = threading.Thread(target=lambda: raw.extend(iter(proc.stdout.readline, b"")))
    reader.start()
    try:
        wait_for(lambda: any(b"Ctrl-C stops" in x for x in raw), 60, what="stack ready")
        am = next(x for x in raw if x.startswith(b"Alertmanager")).split()[1].decode()
        assert post(f"{am}/api/v2/alerts", [EVIL]) == 200
        line = wait_for(lambda: next((x for x in raw if b"Evil" in x), None), 60,
                        what="the alert printed")
        # Prometheus's lifecycle API is off: any local user could otherwise stop the stack.
        assert post(f"http://127.0.0.1:{prom_port}/-/quit", {}) == 403
        assert post(f"http://127.0.0.1:{prom_port}/-/reload", {}) == 403
        assert proc.poll() is None
    finally:
        code = stop_stack(proc, reader)
    out = b"".join(raw)
    assert b"\x1b" not in out and b"\x07" not in out, out
    assert "\u202e".encode() not in out
    assert b"Evil\\x1b]52;c;cm0gLXJmIH4=\\x07" in line and b"\\x1b[2J" in line, line
    assert code == 0 and b"stack stopped" in raw[-1], out  # exited by SIGTERM, not /-/quit


def test_scaleout_receiver_and_summary_print_alerts_cleaned(capsys):
    _Receiver.received = []
    hook = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{hook.server_address[1]}/page"
    try:
        firing = {**EVIL, "status": "firing"}
        assert post(url, {"alerts": [firing, "not an alert", {"labels": [1]}]}) == 200
        assert post(url, ["not", "a", "notification"]) == 200
        assert post(url, {"alerts": {"labels": "x"}}) == 200
    finally:
        hook.shutdown()
        hook.server_close()
    printed = capsys.readouterr().out
    summary = "\n".join(pages_summary(_Receiver.received))
    for text in (printed, summary):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
        assert "Evil\\x1b]52;c;cm0gLXJmIH4=\\x07" in text, text
    assert summary.startswith("alerts notified: 1\n"), summary  # the rest never fired
