"""DdpmonHangHolder at scale: N simulated ranks of one run in a real Prometheus.

All ranks but a few wait, stuck, in all-reduce #S on process group 0; the few (``--holders``)
last issued #S-1 there and are stuck in their data loader. The activity series each rank
exports (``ddpmon_collective_sequence``, ``ddpmon_collective_inflight_sequence``,
``ddpmon_stuck_seconds``; docs/slow-and-stuck/hangs.md) are written as OpenMetrics every 15 s
over 10 minutes, backfilled with ``promtool tsdb create-blocks-from openmetrics`` and served by
a real Prometheus. The alert's expression (from the shipped MixinConfig) and the queries its
description runs are timed as instant queries at the end (median of ``--repeats``), and the
ranks the alert names are checked: exactly the holders, not the thousands that wait.

Usage: ``python benchmarks/hang_rule_scale.py [--ranks 16384] [--holders 3]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_openmetrics(path: Path, ranks: int, holders: set[int], end: int) -> int:
    seq = 36
    times = range(end - 600, end + 1, 15)
    out = path.open("w")
    n = 0

    def series(name: str, labels: str, values) -> None:
        nonlocal n
        out.write(f"# TYPE {name} gauge\n")
        for r in range(ranks):
            v = values(r)
            if v is None:
                continue
            lab = labels.format(r=r, i=f"node{r // 8}:{7470 + r % 8}")
            for t in times:
                out.write(f"{name}{{{lab}}} {v} {t}\n")
                n += 1

    base = 'job="ddpmon",instance="{i}",run="big",rank="{r}"'
    series("ddpmon_collective_sequence", base + ',group="0"',
           lambda r: seq - 1 if r in holders else seq)
    series("ddpmon_collective_inflight_sequence", base + ',group="0",op="all_reduce"',
           lambda r: None if r in holders else seq)
    out.write("# TYPE ddpmon_stuck_seconds gauge\n")
    for r in range(ranks):
        held = r in holders
        lab = base.format(r=r, i=f"node{r // 8}:{7470 + r % 8}") + (
            ',phase="data",frame="data.py:37 in __getitem__",quiet="0"' if held else
            ',phase="forward_backward",frame="train.py:87 in main",quiet="0"')
        for t in times:
            out.write(f"ddpmon_stuck_seconds{{{lab}}} {40 + t - times[0]} {t}\n")
            n += 1
    out.write("# EOF\n")
    out.close()
    return n


def instant(url: str, promql: str, at: int) -> tuple[float, list]:
    q = urllib.parse.urlencode({"query": promql, "time": str(at)})
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=120) as resp:
        body = json.load(resp)
    return time.perf_counter() - t0, body["data"]["result"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--holders", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from ddpmon.mixin.alerts import hangs
    from ddpmon.mixin.config import MixinConfig
    from ddpmon.services import Prometheus
    from ddpmon.services.process import find_binary

    cfg = MixinConfig()
    holders = set(random.Random(48).sample(range(args.ranks), args.holders))
    end = (int(time.time()) // 60) * 60 - 3600
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        om = base / "activity.om"
        t0 = time.perf_counter()
        samples = write_openmetrics(om, args.ranks, holders, end)
        print(f"{samples:,} samples for {args.ranks:,} ranks in {time.perf_counter() - t0:.1f} s")
        data = base / "prometheus" / "data"
        data.mkdir(parents=True)
        subprocess.run([find_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                        "-q", str(om), str(data)], check=True)
        (base / "sd").mkdir()
        prom = Prometheus(base / "prometheus", sd_dir=base / "sd")
        prom.start(timeout=600)
        try:
            rule = hangs.alerts(cfg)[0]
            queries = {
                "DdpmonHangHolder expr": rule.expr,
                "description: waiting ranks": f"topk({cfg.alert_rank_cap}, "
                + hangs.waiting(cfg, 'run="big",group="0"') + ")",
                "description: the collective": "max(" + hangs.waiting(cfg, 'run="big",group="0"')
                + ")",
            }
            for name, promql in queries.items():
                instant(prom.url, promql, end)  # warm the head
                runs, result = [], []
                for _ in range(args.repeats):
                    seconds, result = instant(prom.url, promql, end)
                    runs.append(seconds)
                print(f"{name}: median {statistics.median(runs) * 1000:.0f} ms "
                      f"(max {max(runs) * 1000:.0f} ms), {len(result)} series")
                if name == "DdpmonHangHolder expr":
                    named = sorted(int(s["metric"]["rank"]) for s in result)
                    assert named == sorted(holders), (named, sorted(holders))
                    print(f"  names ranks {named} (the holders), phase "
                          f"{result[0]['metric']['phase']}, frame {result[0]['metric']['frame']}")
        finally:
            prom.stop()


if __name__ == "__main__":
    main()
