"""One HTTP call over a daemon's agent socket, with its status: what the agent's own client does,
minus the never-raise wrapper, so a test sees the daemon's answer. Run as a module it makes the
call from a separate process (``python -m tests.support.agent_call PATH METHOD TARGET [JSON]``,
printing ``STATUS BODY``): the daemon then sees that process, not the test, as the caller."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ddpmon.export.registration import AgentSocketConnection


def call(path: str | Path, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    conn = AgentSocketConnection(path, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, target, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = raw.decode("utf-8", "replace")
    return resp.status, doc


def wait_for_socket(path: Path, timeout: float = 30) -> None:
    """The daemon opens its agent socket right after its TCP port."""
    deadline = time.monotonic() + timeout
    while not path.is_socket():
        assert time.monotonic() < deadline, f"no agent socket at {path}"
        time.sleep(0.05)


if __name__ == "__main__":
    sock, method, target = sys.argv[1:4]
    payload = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    listener = None
    if isinstance(payload, dict) and payload.get("port") == 0:  # this process's own endpoint
        listener = socket.create_server(("127.0.0.1", 0))
        payload["port"] = listener.getsockname()[1]
    status, doc = call(sock, method, target, payload)
    print(status, json.dumps(doc))
