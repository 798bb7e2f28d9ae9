"""``ddpmon stack``: Prometheus + Alertmanager with the shipped configs, on loopback, until Ctrl-C.

Point it at ranks that publish file_sd targets (``ddpmon demo --sd-dir ddpmon-runs/sd``, or
``DDPMON_SD_DIR`` for your own job). Alertmanager's webhooks go to a receiver inside this
command that prints each notification, so alerts are visible without any external service.
Data lives in a temporary directory that is removed on exit. The Prometheus and Alertmanager
configs are the shipped ones (the checkout's ``deploy/``, or the copies in the wheel); the rules
are generated for ``--config`` (default: the shipped config).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ddpmon.terminal import clean, clean_line

from ._generated import load

DEFAULT_SD_DIR = "ddpmon-runs/sd"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stack",
        help="run Prometheus + Alertmanager (Debian packages) with the shipped config on loopback",
    )
    p.add_argument(
        "--sd-dir", default=DEFAULT_SD_DIR,
        help=f"file_sd directory the ranks publish into (default {DEFAULT_SD_DIR})",
    )
    p.add_argument("--prometheus-port", type=int, default=9090, help="0 = any free port")
    p.add_argument("--alertmanager-port", type=int, default=9093, help="0 = any free port")
    p.add_argument("--scrape-interval", default=None, help="override the shipped 5s")
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="YAML file overriding MixinConfig fields for the rules this stack evaluates",
    )
    p.add_argument(
        "--for-seconds", type=float, default=None,
        help="stop after this many seconds (default: run until Ctrl-C/SIGTERM)",
    )
    p.set_defaults(func=run)


MAX_WEBHOOK_BYTES = 4 * 1024 * 1024
"""The largest notification the printing receiver reads (Alertmanager's are a few KiB)."""


def alerts_of(payload: Any) -> list[dict[str, Any]]:
    """The alerts of a webhook notification, whatever was POSTed: only dicts, with ``labels``
    and ``annotations`` dicts (any local user can POST to the receiver or to Alertmanager)."""
    found = payload.get("alerts") if isinstance(payload, dict) else None
    out = []
    for alert in found if isinstance(found, list) else ():
        if isinstance(alert, dict):
            labels, notes = alert.get("labels"), alert.get("annotations")
            out.append({**alert, "labels": labels if isinstance(labels, dict) else {},
                        "annotations": notes if isinstance(notes, dict) else {}})
    return out


def alert_line(alert: dict[str, Any], receiver: str = "") -> str:
    """One alert on one terminal line: every field from outside goes through the terminal
    cleaner (an alert's labels and annotations are whatever its sender chose: a run id with
    ESC in ``{{ $labels.run }}``, or an alert POSTed to Alertmanager by any local user)."""

    labels, notes = alert["labels"], alert["annotations"]
    where = f"{clean_line(receiver)}: " if receiver else ""
    return clean_line(
        f"{where}{str(alert.get('status', '?')).upper()} {labels.get('alertname', '?')} "
        f"({labels.get('severity', '?')}) {notes.get('description', '')}"
    )


class AlertPrinter(BaseHTTPRequestHandler):
    """Alertmanager webhook receiver that prints one line per alert (``ddpmon stack``,
    ``ddpmon scaleout``); a subclass with a ``received`` list also keeps the alerts."""

    prefix = ""
    received: list[dict[str, Any]] | None = None

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        try:
            length = min(max(int(self.headers.get("Content-Length", "0")), 0),
                         MAX_WEBHOOK_BYTES)
            payload: Any = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, RecursionError):
            payload = {}
        for alert in alerts_of(payload):
            if self.received is not None:
                self.received.append(alert)
            print(f"{self.prefix}[{time.strftime('%H:%M:%S')}] "
                  f"{alert_line(alert, self.path.strip('/'))}", flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import render  # loaded when the command runs: a light CLI start
    from ddpmon.services import Alertmanager, Prometheus, StackError

    cfg = load(args)
    sd_dir = Path(args.sd_dir).resolve()
    sd_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = ThreadingHTTPServer(("127.0.0.1", 0), AlertPrinter)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    workdir = tempfile.TemporaryDirectory(prefix="ddpmon-stack-")
    am = prom = None
    try:
        # The rules are generated for this config, so the stack works from a wheel too.
        rule_files = render.write(Path(workdir.name) / "rules", cfg)
        am = Alertmanager(
            Path(workdir.name) / "alertmanager",
            webhook_url=f"http://127.0.0.1:{hook.server_address[1]}",
            port=args.alertmanager_port or None,
        )
        prom = Prometheus(
            Path(workdir.name) / "prometheus", sd_dir=sd_dir, rule_files=rule_files,
            alertmanager=am.address, scrape_interval=args.scrape_interval,
            port=args.prometheus_port or None,
        )
        am.start()
        prom.start()
        print(f"Prometheus   {prom.url}  (alerts: {prom.url}/alerts, targets: {prom.url}/targets)")
        print(f"Alertmanager {am.url}")
        print(f"file_sd      {sd_dir}/*.json")
        print(f"data         {workdir.name} (removed on exit)")
        print(
            f"Start ranks that publish there, e.g. `ddpmon demo --sd-dir {args.sd_dir}`; "
            "notifications are printed below. Ctrl-C stops.",
            flush=True,
        )
        deadline = None if args.for_seconds is None else time.monotonic() + args.for_seconds
        while not stop.wait(0.5):
            for server in (prom, am):
                code = server.poll()
                if code is not None:
                    print(f"{type(server).__name__} exited ({code}); stopping", file=sys.stderr)
                    return 1
            if deadline is not None and time.monotonic() >= deadline:
                break
        return 0
    except StackError as exc:  # may quote a service's log: cleaned like every outside text

        print(f"ddpmon stack: {clean(exc)}", file=sys.stderr)
        return 1
    finally:
        for server in (prom, am):
            if server is not None:
                server.stop()
        hook.shutdown()
        hook.server_close()
        workdir.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("stack stopped", flush=True)
