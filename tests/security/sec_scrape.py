"""A scraper in its own process, like Prometheus: one TLS + basic-auth scrape per interval on a
fresh connection, printing one JSON line of (latency seconds, status) pairs at the end.

    python sec_scrape.py --port P --cafile CA --user U --password PW --seconds S
    python sec_scrape.py --port P --plain --path /metrics --path /sd --seconds S

With several ``--path``, each interval takes the next one in turn.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import ssl
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cafile")
    ap.add_argument("--user")
    ap.add_argument("--password")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args()
    paths = args.path or ["/metrics"]
    headers = {}
    if args.user:
        token = base64.b64encode(f"{args.user}:{args.password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    results: list[tuple[float, int | str]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        conn: http.client.HTTPConnection
        if args.plain:
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=5)
        else:
            ctx = ssl.create_default_context(cafile=args.cafile)
            conn = http.client.HTTPSConnection("127.0.0.1", args.port, timeout=5, context=ctx)
        try:
            conn.request("GET", paths[len(results) % len(paths)], headers=headers)
            resp = conn.getresponse()
            resp.read()
            status: int | str = resp.status
        except Exception as exc:
            status = type(exc).__name__
        finally:
            conn.close()
        results.append((time.perf_counter() - t0, status))
        time.sleep(args.interval)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
