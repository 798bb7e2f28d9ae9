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


class AlertPrinter(BaseHTTPRequestHandler):
    """Alertmanager webhook receiver that prints one line per alert (``ddpmon stack``,
    ``ddpmon scaleout``); a subclass with a ``received`` list also keeps the alerts."""

    prefix = ""
    received: list[dict[str, Any]] | None = None

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        length = int(self.headers.get("Content-Length", "0"))
        try:
            payload: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            payload = {}
        for alert in payload.get("alerts", []):
            labels, notes = alert.get("labels", {}), alert.get("annotations", {})
            if self.received is not None:
                self.received.append(alert)
            print(
                f"{self.prefix}[{time.strftime('%H:%M:%S')}] {self.path.strip('/')}: "
                f"{alert.get('status', '?').upper()} {labels.get('alertname', '?')} "
                f"({labels.get('severity', '?')}) {notes.get('description', '')}",
                flush=True,
            )
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import render
    from ddpmon.services import Alertmanager, Prometheus, StackError

    from ._generated import load

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
    except StackError as exc:
        print(f"ddpmon stack: {exc}", file=sys.stderr)
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
