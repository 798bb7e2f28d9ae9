"""Raw-socket HTTP fuzzer, run as a separate process so its CPU use does not distort the
training-loop timings measured in the test process.

    python sec_fuzz.py --port P --requests N --seed S --seconds T [--daemon] [--workers W]

Each connection sends one or more generated requests (bad methods, huge headers, junk paths
and query strings, non-HTTP bytes, mutated valid requests), half-closes and reads whatever
comes back. Prints one JSON object: requests sent, connections, status counts, connections
closed without a response, timeouts, resets, and the 5xx responses seen (with the request).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import threading
import time
from collections import Counter

METHODS = [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE",
           b"CONNECT", b"PRI", b"get", b"G ET", b"GET\x00", b"\xff\xfe", b""]
PATHS = [b"/metrics", b"/", b"/metrics/", b"/index.html", b"/../../etc/passwd", b"//metrics",
         b"/metrics%00", b"/%2e%2e/", b"*", b"http://evil/metrics", b"/metrics#frag",
         b"/\xff\xfe", b"/" + b"A" * 3000]
DAEMON_PATHS = [b"/healthz", b"/sd", b"/api/v1/jobs", b"/api/v1/jobs/abc",
                b"/api/v1/jobs/../../x", b"/api/v1/jobs/abc/logs?tail=-1",
                b"/api/v1/jobs/abc/logs?tail=99999999999999999999", b"/api/v1/ranks",
                b"/api/v1/ranks/run/0", b"/api/v1/ranks/r/-1", b"/api/v1/ranks/%00/x",
                b"/openapi.json", b"/docs"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1x", b"HTTPS/1.1",
            b"", b"HTTP/1.1 extra"]
JSON_BODIES = [b"{}", b"[]", b"null", b'{"run": "x", "rank": 0}', b'{"entrypoint": "x"}',
               b'{"run": "' + b"a" * 5000 + b'", "rank": 1e309}', b"{", b'{"a":' * 200,
               b'{"run":"r","rank":0,"pid":1,"port":70000,"host":"127.0.0.1"}',
               b"\xff\xfe\x00", b'{"argv": ["--x"], "nproc": -1}']


def rand_bytes(rng: random.Random, lo: int, hi: int) -> bytes:
    return rng.randbytes(rng.randint(lo, hi))


def junk_query(rng: random.Random) -> bytes:
    kinds = [
        lambda: b"?" + rand_bytes(rng, 1, 200).replace(b" ", b"+").replace(b"\r", b"")
        .replace(b"\n", b""),
        lambda: b"?" + b"&".join(b"name[]=%d" % i for i in range(rng.randint(1, 400))),
        lambda: b"?" + b"%" * rng.randint(1, 50) + b"%zz%00%ff",
        lambda: b"?" + "ümlaut=€".encode() * rng.randint(1, 20),
        lambda: b"?q=" + b"A" * rng.randint(1000, 10000),
    ]
    return rng.choice(kinds)()


def request(rng: random.Random, daemon: bool) -> bytes:
    """One generated request (or non-request), as raw bytes."""
    paths = PATHS + DAEMON_PATHS if daemon else PATHS
    kind = rng.randrange(10)
    if kind == 0:  # bad or random method
        method = rng.choice(METHODS + [rand_bytes(rng, 1, 20), b"X" * rng.randint(20, 3000)])
        return method + b" " + rng.choice(paths) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    if kind == 1:  # huge headers
        if rng.random() < 0.5:
            hdrs = b"X-Big: " + b"a" * rng.randint(5000, 100_000) + b"\r\n"
        else:
            hdrs = b"".join(b"X-%d: v\r\n" % i for i in range(rng.randint(50, 2000)))
        return b"GET /metrics HTTP/1.1\r\n" + hdrs + b"\r\n"
    if kind == 2:  # junk paths and query strings
        path = rng.choice(paths + [b"/" + rand_bytes(rng, 1, 100).replace(b" ", b"")])
        return b"GET " + path + junk_query(rng) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    if kind == 3:  # non-HTTP bytes
        choice = rng.randrange(4)
        if choice == 0:
            return rand_bytes(rng, 1, 4096)
        if choice == 1:  # TLS ClientHello-like record to a plain port
            return b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rand_bytes(rng, 32, 600)
        if choice == 2:  # HTTP/2 preface
            return b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rand_bytes(rng, 0, 100)
        return b"\r\n" * rng.randint(1, 2000)
    if kind == 4:  # bad versions and request lines
        return b"GET " + rng.choice(paths) + b" " + rng.choice(VERSIONS) + b"\r\n\r\n"
    if kind == 5:  # header syntax abuse
        bad = rng.choice([
            b"Content-Length: -1\r\n", b"Content-Length: 99999999999999999999\r\n",
            b"Content-Length: 1\r\nContent-Length: 2\r\n", b"Transfer-Encoding: chunked\r\n",
            b"Transfer-Encoding: chunked, identity\r\n", b" folded: x\r\n", b"NoColon\r\n",
            b"X: \x00\x01\x02\r\n",
            b"Host: " + rand_bytes(rng, 1, 50).replace(b"\n", b"") + b"\r\n",
            b"Authorization: Basic !!!!\r\n", b"Authorization: Basic " + b"QQ==" * 2000 + b"\r\n",
            b"Authorization: Bearer " + rand_bytes(rng, 1, 60).replace(b"\n", b"") + b"\r\n",
            b"Connection: upgrade\r\nUpgrade: websocket\r\n", b"Expect: 100-continue\r\n",
            b"Accept-Encoding: " + b"gzip," * 500 + b"\r\n",
        ])
        return b"GET " + rng.choice(paths) + b" HTTP/1.1\r\n" + bad + b"\r\n"
    if kind == 6:  # mutated valid request
        base = bytearray(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n")
        for _ in range(rng.randint(1, 8)):
            op, i = rng.randrange(3), rng.randrange(len(base))
            if op == 0:
                base[i] = rng.randrange(256)
            elif op == 1:
                base.insert(i, rng.randrange(256))
            else:
                del base[i]
        if rng.random() < 0.3:
            base = base[: rng.randrange(len(base))]
        return bytes(base)
    if kind == 7:  # bodies, for the daemon's JSON API and for the agent's refusal
        method = rng.choice([b"POST", b"PUT", b"DELETE", b"PATCH"])
        path = rng.choice(paths)
        body = rng.choice(JSON_BODIES + [rand_bytes(rng, 0, 3000)])
        ctype = rng.choice([b"application/json", b"text/plain", b"multipart/form-data", b""])
        token = b"Authorization: Bearer wrong\r\n" if rng.random() < 0.5 else b""
        length = len(body) if rng.random() < 0.8 else rng.choice([0, len(body) + 10])
        return (method + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + ctype
                + b"\r\n" + token + b"Content-Length: %d\r\n\r\n" % length + body)
    # kinds 8, 9: well-formed requests, the control group
    method = rng.choice([b"GET", b"HEAD"])
    return method + b" " + rng.choice(paths[:2] if not daemon else [b"/metrics", b"/healthz",
                                                                     b"/sd", b"/api/v1/jobs"]
                                      ) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")


class Fuzzer:
    def __init__(self, port: int, seed: int, daemon: bool, deadline: float, budget: int) -> None:
        self.port, self.seed, self.daemon = port, seed, daemon
        self.deadline, self.budget = deadline, budget
        self.lock = threading.Lock()
        self.sent = 0
        self.connections = 0
        self.statuses: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.server_errors: list[str] = []

    def take(self, n: int) -> int:
        with self.lock:
            n = min(n, self.budget - self.sent)
            self.sent += max(n, 0)
            if n > 0:
                self.connections += 1
            return n

    def worker(self, wid: int) -> None:
        rng = random.Random(self.seed * 1000 + wid)
        while time.monotonic() < self.deadline:
            want = 1 if rng.random() < 0.7 else rng.randint(2, 6)
            n = self.take(want)
            if n <= 0:
                return
            reqs = [request(rng, self.daemon) for _ in range(n)]
            self.one_connection(rng, reqs)

    def one_connection(self, rng: random.Random, reqs: list[bytes]) -> None:
        data = b"".join(reqs)
        reply = b""
        outcome = "answered"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                if rng.random() < 0.1 and len(data) > 10:  # split writes
                    cut = rng.randrange(1, len(data))
                    s.sendall(data[:cut])
                    time.sleep(0.01)
                    s.sendall(data[cut:])
                else:
                    s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while len(reply) < 4_000_000:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
        except TimeoutError:
            outcome = "timeout"
        except (ConnectionResetError, BrokenPipeError):
            outcome = "reset"
        except OSError as exc:
            outcome = f"oserror:{exc.errno}"
        codes = STATUS.findall(reply)
        if not codes and outcome == "answered":
            outcome = "closed_without_response"
        with self.lock:
            self.outcomes[outcome] += 1
            for code in codes:
                self.statuses[code.decode()] += 1
                if code.startswith(b"5") and len(self.server_errors) < 20:
                    self.server_errors.append(f"{code.decode()} for {data[:300]!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--daemon", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    fz = Fuzzer(args.port, args.seed, args.daemon, t0 + args.seconds, args.requests)
    threads = [threading.Thread(target=fz.worker, args=(i,)) for i in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({
        "requests": fz.sent,
        "connections": fz.connections,
        "seconds": round(time.monotonic() - t0, 2),
        "statuses": dict(sorted(fz.statuses.items())),
        "outcomes": dict(sorted(fz.outcomes.items())),
        "server_errors": fz.server_errors,
    }))


if __name__ == "__main__":
    main()
