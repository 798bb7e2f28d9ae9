"""Rank registration with a ``ddpmon daemon``, as called by the agent.

Standard library only, short timeouts, never raises: discovery is a convenience and must never
break or slow down training. A failure is logged once per process (not once per call).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

log = logging.getLogger("ddpmon.daemon.client")

TIMEOUT_SECONDS = 2.0
_warned = threading.Event()

__all__ = ["deregister_rank", "register_rank"]


def _payload(info: dict[str, Any]) -> dict[str, Any]:
    doc = dict(info)
    doc.setdefault("pid", os.getpid())
    if "host" not in doc and "target" in doc:
        doc["host"] = str(doc["target"]).rsplit(":", 1)[0]
    job_id = doc.get("job_id") or os.environ.get("DDPMON_JOB_ID")
    if job_id:
        doc["job_id"] = job_id
    else:
        doc.pop("job_id", None)
    return doc


def _request(method: str, url: str, body: dict[str, Any] | None) -> None:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS) as resp:
        resp.read()


def _report(action: str, daemon_url: str, exc: BaseException) -> None:
    detail = str(exc)
    if isinstance(exc, urllib.error.HTTPError):
        try:
            detail = f"HTTP {exc.code}: {exc.read(500).decode('utf-8', 'replace')}"
        except Exception:
            detail = f"HTTP {exc.code}"
    if not _warned.is_set():
        _warned.set()
        log.warning("ddpmon daemon %s at %s failed (%s); continuing", action, daemon_url, detail)
    else:
        log.debug("ddpmon daemon %s at %s failed: %s", action, daemon_url, detail)


def register_rank(daemon_url: str, info: dict[str, Any]) -> None:
    """POST this rank (run, rank, local_rank, node, pid, port, host[, job_id]) for /sd."""
    try:
        _request("POST", daemon_url.rstrip("/") + "/api/v1/ranks", _payload(info))
    except Exception as exc:
        _report("registration", daemon_url, exc)


def deregister_rank(daemon_url: str, info: dict[str, Any]) -> None:
    """DELETE this rank's registration; a daemon that no longer knows it is fine."""
    try:
        run = urllib.parse.quote(str(info["run"]), safe="")
        url = f"{daemon_url.rstrip('/')}/api/v1/ranks/{run}/{int(info['rank'])}"
        _request("DELETE", url, None)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            _report("deregistration", daemon_url, exc)
    except Exception as exc:
        _report("deregistration", daemon_url, exc)
