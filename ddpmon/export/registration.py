"""Rank registration with a ``ddpmon daemon``, as called by the agent.

Standard library only, short timeouts, never raises: discovery is a convenience and must never
break or slow down training. A failure is logged once per process (not once per call).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..web.agent_socket import connect

log = logging.getLogger("ddpmon.registration")

TIMEOUT_SECONDS = 2.0
_warned = threading.Event()
_learned: dict[str, str] = {}
"""daemon URL -> the agent socket its answer named."""

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


class AgentSocketConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the daemon's agent socket."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = TIMEOUT_SECONDS) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = connect(self.socket_path, self.timeout)


def _agent_socket(daemon_url: str) -> str | None:
    """Where to register: ``unix:PATH`` as the URL, $DDPMON_DAEMON_SOCKET (set for the jobs the
    daemon launches), or the path a daemon named in an earlier answer."""
    if daemon_url.startswith("unix:"):
        return daemon_url.removeprefix("unix:").removeprefix("//") or None
    return os.environ.get("DDPMON_DAEMON_SOCKET") or _learned.get(daemon_url)


def _over_socket(path: str, method: str, target: str, body: dict[str, Any] | None) -> None:
    data = None if body is None else json.dumps(body).encode()
    conn = AgentSocketConnection(path)
    try:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, target, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read(4096)
        if resp.status >= 400:
            raise _Refused(resp.status, text.decode("utf-8", "replace"))
    finally:
        conn.close()


def _request(daemon_url: str, method: str, target: str, body: dict[str, Any] | None) -> None:
    """One registration call: on the agent socket when it is known, else over HTTP once to learn
    it (the daemon refuses registrations over TCP and names its socket)."""
    path = _agent_socket(daemon_url)
    if path is None:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(daemon_url.rstrip("/") + target, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS) as resp:
                resp.read()
            return
        except urllib.error.HTTPError as exc:
            path = _socket_named(exc)
            if path is None:
                raise
            _learned[daemon_url] = path
    _over_socket(path, method, target, body)


def _socket_named(exc: urllib.error.HTTPError) -> str | None:
    if exc.code != 403:
        return None
    try:
        doc = json.loads(exc.read(4096))
    except ValueError:
        return None
    path = doc.get("agent_socket") if isinstance(doc, dict) else None
    return path if isinstance(path, str) and path else None


class _Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:500]}")
        self.status = status


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
    """POST this rank (run, rank, local_rank, node, pid, port, host[, job_id]) for /sd.
    ``daemon_url`` is the daemon's HTTP URL or ``unix:PATH`` of its agent socket."""
    try:
        _request(daemon_url, "POST", "/api/v1/ranks", _payload(info))
    except Exception as exc:
        _report("registration", daemon_url, exc)


def deregister_rank(daemon_url: str, info: dict[str, Any]) -> None:
    """DELETE this rank's registration; a daemon that no longer knows it is fine."""
    try:
        run = urllib.parse.quote(str(info["run"]), safe="")
        _request(daemon_url, "DELETE", f"/api/v1/ranks/{run}/{int(info['rank'])}", None)
    except (urllib.error.HTTPError, _Refused) as exc:
        if getattr(exc, "code", getattr(exc, "status", None)) != 404:
            _report("deregistration", daemon_url, exc)
    except Exception as exc:
        _report("deregistration", daemon_url, exc)
