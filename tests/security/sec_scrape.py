"""A scraper in its own process, like Prometheus: one TLS + basic-auth scrape per interval on a
fresh connection, printing one JSON line of (latency seconds, status) pairs at the end.

    python sec_scrape.py --port P --cafile CA --user U --password PW --seconds S
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
    ap.add_argument("--cafile", required=True)
    ap.add_argument("--user", required=True)
    ap.add_argument("--password", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args()
    ctx = ssl.create_default_context(cafile=args.cafile)
    token = base64.b64encode(f"{args.user}:{args.password}".encode()).decode()
    results: list[tuple[float, int | str]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        conn = http.client.HTTPSConnection("127.0.0.1", args.port, timeout=5, context=ctx)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
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
