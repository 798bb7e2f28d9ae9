"""The daemon's agent socket: a Unix socket on which ranks register, so that the kernel, not the
request, says which process is calling.

A registration over TCP names a PID and a host that anyone on the node could make up. Over a
Unix socket the daemon reads the caller's PID, UID and GID with ``SO_PEERCRED`` (Linux): a rank
can register only its own process, and only the owner of a live entry can remove it.

Unix socket paths are limited to about 107 bytes; a longer path (a deep state dir) is reached
through ``/proc/self/fd/N/NAME`` with ``N`` a descriptor on its directory, on both ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_PATH_BYTES = 100
"""Below the kernel's 108-byte ``sun_path``, with room for its terminating NUL."""

SOCKET_NAME = "agent.sock"


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is at the other end of an agent-socket connection (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


class AgentSocketError(Exception):
    """The agent socket cannot be set up (its message names the path and why)."""


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


@contextlib.contextmanager
def _short(path: Path) -> Iterator[str]:
    """A path to ``path`` that fits ``sun_path``: itself, or through a descriptor on its dir."""
    if len(os.fsencode(path)) <= MAX_PATH_BYTES:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def connect(path: str | Path, timeout: float) -> socket.socket:
    """A connected stream socket to the agent socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        with _short(Path(path)) as short:
            sock.connect(short)
    except BaseException:
        sock.close()
        raise
    return sock


def listen(path: Path) -> socket.socket:
    """Bind and listen on ``path``, replacing a stale socket file left by a dead daemon.

    Refuses when another daemon answers there, or when ``path`` is something else than a
    socket (never deletes a regular file someone pointed ``--agent-socket`` at)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise AgentSocketError(f"agent socket {path}: {exc.strerror or exc}") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentSocketError(f"agent socket {path}: exists and is not a socket")
        try:
            connect(path, timeout=1.0).close()
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise AgentSocketError(f"agent socket {path}: {exc.strerror or exc}") from None
            path.unlink(missing_ok=True)  # stale: nobody listens
        else:
            raise AgentSocketError(f"agent socket {path}: another daemon is serving it")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as short:
            sock.bind(short)
        # Anyone who can reach the directory may connect: the peer check, not the mode, decides
        # what a caller may register (ranks of other users, with --agent-socket outside a 0700
        # state dir).
        os.chmod(path, 0o666)
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise AgentSocketError(f"agent socket {path}: {exc.strerror or exc}") from None
    return sock
