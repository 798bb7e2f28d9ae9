"""The suite's one free-port helper: TCP ports for test servers, outside the ephemeral range.

``bind(("", 0))`` hands out ports from the ephemeral range, the same range the kernel uses for
every outgoing connection and for gloo's listening sockets. A port probed that way and released
can be taken by the next connect() of any process before the test's server binds it. Ports below
the range are never handed out implicitly, so only another explicit bind can take them (a
server that still loses that race is started again by its caller: ``ranks.launch_ranks``).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FLOOR = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, tries: int = 500, host: str = "127.0.0.1") -> int:
    """A base port ``p`` with ``p .. p + count - 1`` free on ``host`` a moment ago."""
    high = _ephemeral_low() - count
    rng = random.SystemRandom()
    for _ in range(tries):
        base = rng.randrange(_FLOOR, high)
        if all(_bindable(base + i, host) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {_FLOOR}-{high}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port that was free on ``host`` a moment ago."""
    return free_ports(1, host=host)


def free_port_pair() -> int:
    """A base port ``p`` with ``p`` and ``p + 1`` free (rank r serves p + r)."""
    return free_ports(2)
