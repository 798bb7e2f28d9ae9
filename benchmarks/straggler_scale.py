"""Straggler and hang naming at scale: N simulated ranks of one DDP run through the shipped rules,
on a real Prometheus or a real VictoriaMetrics (issue 48, part 3).

Straggler. Every rank's step is simulated step by step, as the agent exports it
(``ddpmon.agent.step_split``): per step, data wait, compute and host time, each with noise (a
per-rank bias, sd 0.5 % of compute, and per-step noise: compute sd 2 %, data and host sd 10 %);
the run's step lasts as long as the slowest rank's own work plus the exposed communication, and
every rank waits the rest inside the collective (``part="wait"``). From step ``--start`` one rank
does ``--slowdown`` of the nominal step time more compute per step: it costs the run that share
(with the default 80 % own work per step, its own time is 6.25 % above the others'). Each
rank's counters (step and data-wait ``_sum``/``_count``, ``ddpmon_step_part_seconds_total``,
``ddpmon_step``) are sampled every ``--scrape`` seconds at a per-target offset, backfilled
(``promtool tsdb create-blocks-from openmetrics``, or VictoriaMetrics' import API), and the
shipped expressions (``MixinConfig()``; the records a rule reads inlined) are evaluated at
every ``--scrape`` step as range queries: the rank-health table's ``straggler`` problem (what the
dashboards' slowest-first table and the records name) and the ``DdpmonStraggler`` alert, its
``for`` applied as Prometheus applies it. Reported: the step at which each first names the
straggler, counted from its first slow step, and any other rank ever named.

Hang. ``hang_rule_scale.py``'s activity series (all ranks but ``--holders`` wait in one
all-reduce) in the same store; ``DdpmonHangHolder`` must name exactly the holders.

The straggler records are then evaluated over the last minutes and written back into the store
(as a rule evaluator would), and every rule's expression, reading them, is timed as an instant
query at the end (median of ``--repeats``). Usage:
``python benchmarks/straggler_scale.py [--ranks 1024] [--store prometheus|victoria-metrics]
[--step-seconds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hang_rule_scale  # noqa: E402  (a script beside this one)
import straggler_rules_before as before  # noqa: E402  (the rules of before, for side by side)

from ddpmon import metrics as m  # noqa: E402
from ddpmon.mixin import names as n  # noqa: E402
from ddpmon.mixin import stragglers  # noqa: E402
from ddpmon.mixin.alerts import hangs  # noqa: E402
from ddpmon.mixin.config import MixinConfig  # noqa: E402
from ddpmon.services import Prometheus, VictoriaMetrics, find_binary  # noqa: E402

STORES = ("prometheus", "victoria-metrics")
SHARES = {"data": 0.05, "compute": 0.70, "host": 0.05}
"""Each rank's own work per step, as shares of the nominal step time (the rest: communication
the rank waits in)."""


def simulate(args: argparse.Namespace, straggler: int, t0: float) -> dict[str, np.ndarray]:
    """Per step and rank: cumulative data, compute, host and wait seconds; the steps' end times."""
    rng = np.random.default_rng(args.seed)
    t, ranks, steps = args.step_seconds, args.ranks, args.steps
    bias = rng.normal(0.0, 0.005, ranks)
    data = SHARES["data"] * t * np.clip(1 + 0.1 * rng.standard_normal((steps, ranks)), 0, None)
    host = SHARES["host"] * t * np.clip(1 + 0.1 * rng.standard_normal((steps, ranks)), 0, None)
    compute = SHARES["compute"] * t * (1 + bias + 0.02 * rng.standard_normal((steps, ranks)))
    compute[args.start:, straggler] += args.slowdown * t
    own = data + host + compute
    comm = (1 - sum(SHARES.values())) * t * (1 + 0.05 * rng.standard_normal(steps))
    wall = own.max(axis=1) + np.clip(comm, 0, None)
    wait = wall[:, None] - own
    step = wall[:, None] - data
    cum = {k: np.cumsum(v, axis=0) for k, v in
           {"data": data, "compute": compute, "wait": wait, "step": step}.items()}
    cum["ends"] = t0 + np.cumsum(wall)
    return cum


def straggler_lines(cum: dict[str, np.ndarray], args: argparse.Namespace, ms: bool):
    """Exposition lines per scrape (OpenMetrics, or Prometheus text with ms timestamps)."""
    ends = cum["ends"]
    ranks = args.ranks
    offsets = np.arange(ranks) % args.scrape
    scrapes = np.arange(ends[0] - args.scrape, ends[-1], args.scrape)
    names = {
        "step_sum": f"{m.STEP_DURATION.name}_sum", "step_count": f"{m.STEP_DURATION.name}_count",
        "data_sum": f"{m.DATA_WAIT.name}_sum", "data_count": f"{m.DATA_WAIT.name}_count",
        "compute": f'{m.STEP_PART_SECONDS.name}', "wait": f'{m.STEP_PART_SECONDS.name}',
        "step": m.STEP.name,
    }
    labels = [f'job="ddpmon",instance="node{r // 8}:{7470 + r % 8}",run="big",rank="{r}"'
              for r in range(ranks)]
    for at in scrapes:
        when = at + offsets
        done = np.searchsorted(ends, when, side="right")  # steps completed per rank
        ts = [f"{int(w * 1000)}" if ms else f"{w:.3f}" for w in when]
        out = []
        for r in range(ranks):
            k = done[r]
            if k == 0:
                continue
            i = k - 1
            values = {
                "step_sum": cum["step"][i, r], "step_count": k,
                "data_sum": cum["data"][i, r], "data_count": k,
                "compute": cum["compute"][i, r], "wait": cum["wait"][i, r], "step": k,
            }
            for key, v in values.items():
                extra = f',part="{key}"' if key in ("compute", "wait") else ""
                out.append(f"{names[key]}{{{labels[r]}{extra}}} {v:.6g} {ts[r]}")
        yield out


def openmetrics_header() -> list[str]:
    """Families as ``unknown`` (the rules read ``_sum``/``_count`` only; buckets left out)."""
    fams = [f"{m.STEP_DURATION.name}_sum", f"{m.STEP_DURATION.name}_count",
            f"{m.DATA_WAIT.name}_sum", f"{m.DATA_WAIT.name}_count", m.STEP_PART_SECONDS.name]
    return [f"# TYPE {f} unknown" for f in fams] + [f"# TYPE {m.STEP.name} gauge"]


class Store:
    """The store under test: backfill, queries."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind, self.base = kind, base
        self.server: Prometheus | VictoriaMetrics | None = None
        self.om = base / "series.om"
        self.samples = 0
        if kind == "victoria-metrics":
            self.server = VictoriaMetrics(base / "vm", extra_args=["-search.disableCache",
                                                                   "-search.maxUniqueTimeseries=10000000",
                                                                   "-search.maxQueryDuration=30m"])
            self.server.start(timeout=120)
            self._file = None
        else:
            self._file = self.om.open("w")
            self._file.write("\n".join(openmetrics_header()) + "\n")

    def add(self, lines: list[str]) -> None:
        self.samples += len(lines)
        if self._file is not None:
            if lines:
                self._file.write("\n".join(lines) + "\n")
            return
        for i in range(0, len(lines), 200_000):
            body = ("\n".join(lines[i:i + 200_000]) + "\n").encode()
            req = urllib.request.Request(f"{self.server.url}/api/v1/import/prometheus", body)
            urllib.request.urlopen(req, timeout=600).close()

    def add_openmetrics(self, path: Path) -> None:
        """A file with OpenMetrics sample lines (seconds timestamps) from hang_rule_scale."""
        lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        if self._file is not None:
            self.samples += len(lines)
            self._file.write("\n".join(lines) + "\n")
            return
        self.add([f"{a} {int(b) * 1000}" for a, _, b in (ln.rpartition(" ") for ln in lines)])

    def serve(self) -> str:
        if self._file is not None:
            self._file.write("# EOF\n")
            self._file.close()
            data = self.base / "prometheus" / "data"
            data.mkdir(parents=True)
            subprocess.run([find_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                            "-q", "--max-block-duration=24h", str(self.om), str(data)],
                           check=True, stdout=subprocess.DEVNULL)
            self.om.unlink()
            (self.base / "sd").mkdir()
            self.server = Prometheus(self.base / "prometheus", sd_dir=self.base / "sd",
                                     flags=["--query.max-samples=500000000",
                                            "--query.timeout=30m"])
            self.server.start(timeout=600)
        else:
            self.server.flush()
        return self.server.url

    def record(self, lines: list[str]) -> None:
        """Recorded series (``name{labels} value seconds`` lines) written back into the store,
        as a rule evaluator would: VictoriaMetrics' import API, or Prometheus blocks (promtool,
        then a restart on the same data)."""
        self.samples += len(lines)
        if isinstance(self.server, VictoriaMetrics):
            self.add([f"{a} {int(float(b) * 1000)}" for a, _, b in
                      (ln.rpartition(" ") for ln in lines)])
            self.server.flush()
            return
        names = sorted({ln.split("{", 1)[0] for ln in lines})
        self.om.write_text("\n".join([*(f"# TYPE {x} unknown" for x in names), *lines,
                                      "# EOF"]) + "\n")
        self.server.stop()
        subprocess.run([find_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                        "-q", "--max-block-duration=24h", str(self.om),
                        str(self.base / "prometheus" / "data")],
                       check=True, stdout=subprocess.DEVNULL)
        self.om.unlink()
        self.server.start(timeout=600)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def get(url: str, path: str, params: dict[str, str]) -> tuple[float, list]:
    q = urllib.parse.urlencode(params)
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(f"{url}{path}?{q}", timeout=600) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{path}: {e.read().decode()[-800:]}") from None
    return time.perf_counter() - t0, body["data"]["result"]


def inline(expr: str, records: dict[str, str]) -> str:
    """``expr`` with every record it reads replaced by the record's expression."""
    for _ in range(5):
        for name in sorted(records, key=len, reverse=True):
            expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", f"({records[name]})", expr)
    return expr


def materialise(store: Store, url: str, recs: list[dict], end: int) -> None:
    """The straggler records at ``end``, evaluated from the series (and the records before
    them) and written back, level by level (``straggler_rules_before.levels``). One evaluation
    only: a backfill writes no staleness markers, so a record evaluated earlier with another
    ``cause`` would still be seen (a rule evaluator marks it stale)."""
    for level in before.levels(recs):
        lines = []
        for rec in level:
            _, result = get(url, "/api/v1/query", {"query": rec["expr"], "time": str(end)})
            for s in result:
                metric = {**s["metric"], **rec.get("labels", {})}
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.items())
                                  if k != "__name__")
                lines.append(f"{rec['record']}{{{labels}}} {s['value'][1]} {end}")
        store.record(lines)
        url = store.server.url


def first_firing(series: list, for_s: float) -> dict[str, float]:
    """Per rank, when the alert first fires: its expression true at every evaluation since
    ``for_s`` seconds (an evaluation without it resets the clock, as in Prometheus)."""
    fired = {}
    for s in series:
        since, last = None, None
        for t, _ in s["values"]:
            t = float(t)
            if since is None or last is None or t - last > 1.5 * STEP_S:
                since = t
            last = t
            if t - since >= for_s:
                fired[s["metric"]["rank"]] = t
                break
    return fired


STEP_S = 15.0


def seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915
    global STEP_S
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--store", choices=STORES, default="prometheus")
    p.add_argument("--step-seconds", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=0, help="default: 14 minutes of steps")
    p.add_argument("--start", type=int, default=0, help="first slow step (default: minute 6)")
    p.add_argument("--slowdown", type=float, default=0.05)
    p.add_argument("--scrape", type=int, default=15)
    p.add_argument("--holders", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--alert-range", action=argparse.BooleanOptionalAction, default=None,
                   help="evaluate the alert over the range (default: up to 4,096 ranks; past "
                   "them the alert's step is the naming step plus its for)")
    p.add_argument("--window", default=None, help="straggler_window to try (default: shipped)")
    p.add_argument("--for", dest="for_", default=None, help="straggler_for to try")
    p.add_argument("--no-timings", dest="timings", action="store_false",
                   help="check the naming only (the test's mode)")
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--compare-before", action="store_true",
                   help="also time the rules of before (straggler_rules_before) in the same store")
    args = p.parse_args(argv)
    STEP_S = float(args.scrape)
    if args.alert_range is None:
        args.alert_range = args.ranks <= 4096
    args.steps = args.steps or int(14 * 60 / args.step_seconds)
    args.start = args.start or int(6 * 60 / args.step_seconds)
    cfg = MixinConfig(**{k: v for k, v in (("straggler_window", args.window),
                                           ("straggler_for", args.for_)) if v})
    straggler = random.Random(args.seed).randrange(args.ranks)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    t0 = (int(time.time()) // 60) * 60 - 3 * 3600
    out: dict = {"ranks": args.ranks, "store": args.store, "step_seconds": args.step_seconds,
                 "slowdown": args.slowdown, "straggler": straggler, "cpus": os.cpu_count(),
                 "load_before": load}
    with tempfile.TemporaryDirectory(prefix="ddpmon-strag-scale-") as tmp:
        base = Path(tmp)
        store = Store(args.store, base)
        try:
            started = time.perf_counter()
            cum = simulate(args, straggler, t0)
            for lines in straggler_lines(cum, args, ms=args.store == "victoria-metrics"):
                store.add(lines)
            end = int(cum["ends"][-1])
            holders = set(random.Random(args.seed).sample(range(args.ranks), args.holders))
            hang_om = base / "activity.om"
            hang_rule_scale.write_openmetrics(hang_om, args.ranks, holders, end)
            store.add_openmetrics(hang_om)
            url = store.serve()
            out["samples"] = store.samples
            out["load_seconds"] = round(time.perf_counter() - started, 1)
            print(f"{store.samples:,} samples for {args.ranks:,} ranks, {args.store}, loaded in "
                  f"{out['load_seconds']} s", flush=True)
            out.update(naming(url, cfg, cum, args, straggler))
            _, held = get(url, "/api/v1/query", {"query": hangs.alerts(cfg)[0].expr,
                                                 "time": str(end)})
            out["hang_named"] = sorted(int(s["metric"]["rank"]) for s in held)
            out["hang_holders"] = sorted(holders)
            print(f"DdpmonHangHolder names {out['hang_named']}; holders {sorted(holders)}")
            if args.timings:
                recs = stragglers.records(cfg)
                if args.compare_before:
                    recs = [*before.records(cfg), *recs]
                materialise(store, url, recs, end)
                out["queries"] = timings(store.server.url, cfg, end, args)
            out["seconds"] = round(time.perf_counter() - started, 1)
        finally:
            store.stop()
    out["load_after"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    ok = (out["named_at_step"] is not None and not out["others_named"]
          and out["hang_named"] == sorted(holders))
    return 0 if ok else 1


def naming(url: str, cfg: MixinConfig, cum: dict, args: argparse.Namespace,
           straggler: int) -> dict:
    """When the straggler problem and the alert first name the straggler, in steps."""
    records = before.combined(stragglers.records(cfg))
    ends = cum["ends"]
    slow_from = ends[args.start - 1]
    grid = int(slow_from) // args.scrape * args.scrape
    rng = {"start": str(grid - 5 * 60), "end": str(int(ends[-1])), "step": str(args.scrape)}
    problem = inline(stragglers.problem_expr(cfg), records)
    alert = inline(stragglers.alert(cfg).expr, records)
    # The naming needs the minutes after the start only (a full range times out at 16,384).
    near = {**rng, "start": str(grid - 60), "end": str(min(int(ends[-1]), grid + 300))}
    _, named = get(url, "/api/v1/query_range", {"query": problem, **near})
    firing = get(url, "/api/v1/query_range", {"query": alert, **rng})[1] if args.alert_range else []
    first = {s["metric"]["rank"]: min(float(t) for t, _ in s["values"]) for s in named}
    fired = first_firing(firing, seconds(cfg.straggler_for))

    def steps_after(t: float | None) -> int | None:
        return None if t is None else int(np.searchsorted(ends, t, side="right")) - args.start

    me = str(straggler)
    slowest = f"topk(2, {inline(n.STRAGGLER_SLOWDOWN, records)})"
    _, last = get(url, "/api/v1/query", {"query": slowest, "time": str(int(ends[-1]))})
    mine = [float(s["value"][1]) for s in last if s["metric"].get("rank") == me]
    others = sorted(float(s["value"][1]) for s in last if s["metric"].get("rank") != me)
    causes = {s["metric"].get("cause") for s in firing if s["metric"]["rank"] == me}
    if not args.alert_range and me in first:  # the earliest the alert can fire
        fired[me] = first[me] + seconds(cfg.straggler_for)
    res = {
        "named_at_step": steps_after(first.get(me)),
        "alert_fires_at_step": steps_after(fired.get(me)),
        "alert_for": cfg.straggler_for, "window": cfg.straggler_window,
        "threshold": cfg.straggler_slowdown,
        "others_named": sorted(int(r) for r in first if r != me),
        "others_alerted": sorted(int(r) for r in fired if r != me),
        "cause": sorted(c for c in causes if c),
        "straggler_slowdown_at_end": round(mine[0], 4) if mine else None,
        "highest_other_slowdown_at_end": round(others[-1], 4) if others else None,
    }
    print(f"straggler rank {me}: named at step +{res['named_at_step']}, alert fires at step "
          f"+{res['alert_fires_at_step']} (for {cfg.straggler_for}); cause {res['cause']}; "
          f"slowdown {res['straggler_slowdown_at_end']}, "
          f"next {res['highest_other_slowdown_at_end']}; "
          f"others named {res['others_named']}", flush=True)
    return res


def timings(url: str, cfg: MixinConfig, end: int, args: argparse.Namespace) -> list[dict]:
    """Each straggler record, the rank-health problem and the alert, reading the records as the
    store holds them (:func:`materialise`), and the hang alert's queries, as instant queries at
    the end: median and max of ``--repeats``. With ``--compare-before``, the rules of before
    too (``before: ...``), each right after its shipped counterpart."""
    queries = {}
    for r in stragglers.records(cfg):
        extra = "".join(f" ({k}={v})" for k, v in r.get("labels", {}).items())
        queries[f"record {r['record']}{extra}"] = r["expr"]
    queries["straggler problem (rank-health table)"] = stragglers.problem_expr(cfg)
    queries["DdpmonStraggler expr"] = stragglers.alert(cfg).expr
    if args.compare_before:  # each after its shipped counterpart: the same load, near enough
        old = {f"record {r['record'].replace(before.PREFIX, 'rank:')}": r["expr"]
               for r in before.records(cfg)} | before.queries(cfg)
        # a record of several rules (one per cause): after the first of them
        queries = {k2: v2 for k, v in queries.items()
                   for base in (re.sub(r" \(\w+=[^)]*\)$", "", k),)
                   for k2, v2 in ((k, v), (f"before: {base}", old.get(base))) if v2}
    queries["DdpmonHangHolder expr"] = hangs.alerts(cfg)[0].expr
    queries["DdpmonCollectiveMismatch expr"] = hangs.alerts(cfg)[1].expr
    queries["DdpmonHangHolder description: waiting ranks"] = (
        f"topk({cfg.alert_rank_cap}, " + hangs.waiting(cfg, 'run="big",group="0"') + ")")
    rows = []
    for name, promql in queries.items():
        get(url, "/api/v1/query", {"query": promql, "time": str(end)})  # warm
        runs, result = [], []
        for _ in range(args.repeats):
            s, result = get(url, "/api/v1/query", {"query": promql, "time": str(end)})
            runs.append(s)
        row = {"query": name, "median_s": round(statistics.median(runs), 3),
               "max_s": round(max(runs), 3), "series": len(result),
               "load": round(os.getloadavg()[0], 1)}
        rows.append(row)
        print(f"{name}: median {row['median_s'] * 1000:.0f} ms (max {row['max_s'] * 1000:.0f} ms),"
              f" {row['series']} series, load {row['load']}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
