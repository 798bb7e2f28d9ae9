"""Live-test harness: real Prometheus + Alertmanager from Debian, a webhook receiver, polling.

Typical use (see ``tests/integration/test_alerts_live.py``)::

    cfg = MixinConfig().replace(rank_down_for="3s")           # test-only `for:` overrides
    with WebhookReceiver() as hook, live_stack(tmp_path, sd_dir, cfg, hook.url) as stack:
        ...                                                    # start ranks writing to sd_dir
        wait_for(lambda: stack.prometheus.query("up == 1"), timeout=30, what="targets up")
        alert = hook.wait_for_alert("DdpmonRankDown", timeout=60)

Everything binds 127.0.0.1 on free ports and lives under the given directory; servers are
stopped (SIGTERM, then SIGKILL of their process group) when the context exits, also on error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from ddpmon.mixin import render
from ddpmon.mixin.config import MixinConfig
from ddpmon.services import Alertmanager, Prometheus, PrometheusAPI
from tests.support.ports import free_port

__all__ = [
    "Alertmanager",
    "LiveStack",
    "Prometheus",
    "PrometheusAPI",
    "ReceivedAlert",
    "WebhookReceiver",
    "free_port",
    "live_stack",
    "wait_for",
    "wait_for_scrapes",
]

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float, *, interval: float = 0.25, what: str = "condition"
) -> T:
    """Call ``predicate`` until it returns something truthy and return that; exceptions count as
    "not yet" (a server still starting). Raises ``TimeoutError`` naming ``what`` and the last
    exception."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s (last error: {last_exc!r})")
        time.sleep(interval)


def stop_stack(proc: subprocess.Popen, reader: threading.Thread) -> int:
    """Stop a ``ddpmon stack`` started in its own session: SIGTERM (its clean stop), SIGKILL of
    its whole group if it is still there after 30 s, then the thread reading its output."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=5)


def wait_for_scrapes(
    prom: PrometheusAPI, selector: str, scrapes: int, timeout: float, *, what: str = ""
) -> None:
    """Wait until every series of ``selector`` (one per target, e.g. ``ddpmon_step{run="x"}``)
    has ``scrapes`` more samples than now: "a few more scrapes" for rate windows, counted
    rather than slept, so a loaded machine waits longer instead of failing."""
    def counts() -> dict[str, float]:
        return {
            json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
            for r in prom.query(f"count_over_time({selector}[1h])")
        }

    start = counts()
    wait_for(
        lambda: start and all(counts().get(k, 0.0) >= v + scrapes for k, v in start.items()),
        timeout, what=what or f"{scrapes} more scrapes of {selector}",
    )


@dataclass(frozen=True)
class ReceivedAlert:
    """One alert of one Alertmanager webhook notification, with the local receipt time."""

    received_at: float
    """``time.time()`` when the notification arrived."""
    receiver: str
    """Alertmanager receiver name (the webhook path), e.g. ``ddpmon-critical``."""
    status: str
    """``firing`` or ``resolved``."""
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


@dataclass
class WebhookReceiver:
    """An HTTP server in the test process recording Alertmanager webhook notifications.

    ``url`` is the base URL; Alertmanager posts to ``<url>/<receiver name>``.
    """

    alerts: list[ReceivedAlert] = field(default_factory=list)
    notifications: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                now = time.time()
                length = int(self.headers.get("Content-Length", "0"))
                payload = json.loads(self.rfile.read(length) or b"{}")
                receiver._record(now, self.path.strip("/"), payload)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _record(self, now: float, path: str, payload: dict) -> None:
        with self._lock:
            self.notifications.append({"received_at": now, "path": path, **payload})
            for alert in payload.get("alerts", []):
                self.alerts.append(
                    ReceivedAlert(
                        received_at=now,
                        receiver=path,
                        status=alert.get("status", ""),
                        labels=dict(alert.get("labels", {})),
                        annotations=dict(alert.get("annotations", {})),
                        starts_at=alert.get("startsAt", ""),
                    )
                )
            self._lock.notify_all()

    def firing(self, name: str | None = None) -> list[ReceivedAlert]:
        """Every firing alert received so far (optionally only ``name``)."""
        with self._lock:
            return [
                a for a in self.alerts if a.status == "firing" and (name is None or a.name == name)
            ]

    def wait_for_alert(
        self,
        name: str,
        timeout: float,
        *,
        status: str = "firing",
        where: Callable[[ReceivedAlert], bool] | None = None,
    ) -> ReceivedAlert:
        """The first received alert ``name`` with ``status`` (and ``where``), waiting for it."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for alert in self.alerts:
                    if alert.name == name and alert.status == status and (
                        where is None or where(alert)
                    ):
                        return alert
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = sorted({f"{a.name}/{a.status}" for a in self.alerts})
                    raise TimeoutError(
                        f"no {status} {name} at the webhook within {timeout:g}s; got {seen}"
                    )
                self._lock.wait(min(left, 1.0))

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class LiveStack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    rule_files: list[Path]
    config: MixinConfig

    def firing_in_prometheus(self) -> list[dict]:
        """Alerts Prometheus currently holds as firing (not pending)."""
        return [
            a for a in self.prometheus.api("alerts")["alerts"] if a.get("state") == "firing"
        ]


@contextlib.contextmanager
def live_stack(
    workdir: str | Path,
    sd_dir: str | Path,
    config: MixinConfig,
    webhook_url: str,
    *,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    group_wait: str = "0s",
    prometheus_base: Path | None = None,
    http_sd_urls: list[str] | None = None,
) -> Iterator[LiveStack]:
    """Alertmanager (``group_wait``, group_interval 1s) and Prometheus (1s scrape/eval, file_sd
    over ``sd_dir``) running the shipped configs with rules generated from ``config``."""
    workdir = Path(workdir)
    rule_files = render.write(workdir / "rules", config)
    am = Alertmanager(
        workdir / "alertmanager", webhook_url=webhook_url, group_wait=group_wait,
        group_interval="1s", repeat_interval="1h",
    )
    prom = Prometheus(
        workdir / "prometheus", sd_dir=sd_dir, rule_files=rule_files,
        alertmanager=am.address, scrape_interval=scrape_interval,
        evaluation_interval=evaluation_interval, base=prometheus_base, http_sd_urls=http_sd_urls,
    )
    try:
        am.start()
        prom.start()
        yield LiveStack(prom, am, rule_files, config)
    finally:
        prom.stop()
        am.stop()
