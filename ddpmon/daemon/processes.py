"""Which process is which on this node: a PID is trusted only together with its start time
(PIDs are reused), and ports are probed before they are handed to a job."""

from __future__ import annotations

import errno
import socket

import psutil


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def same_process(pid: int | None, create_time: float | None) -> bool:
    """True when ``pid`` is alive and started at ``create_time`` (not a reused PID)."""
    if not pid or create_time is None:
        return False
    started = process_start_time(pid)
    if started is None or abs(started - create_time) > 0.05:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
