"""``ddpmon scaleout``: the scale-out path on this machine, shown end to end, then stopped.

Starts VictoriaMetrics, the shipped Alertmanager config (webhooks to a receiver in this command
that prints each notification), ``vmalert`` with the rules generated for ``--config`` (default:
the shipped ones) and ``--shards`` vmagent scrapers splitting the targets with ``hashmod``
(``deploy/scaleout/vmagent-scrape.yml``); runs ``ddpmon demo`` through it (4 ranks, a NaN on
rank 1 by default); prints which shard scrapes which rank, what the store holds, the pages and
the rule groups' evaluation time; then stops everything (docs/scale-out.md). Debian's
``victoria-metrics`` and ``prometheus-alertmanager`` (``make debs``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ddpmon.terminal import clean

from ..terminal import clean_line
from .stack import AlertPrinter

RUN_ID = "scaleout-demo"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "scaleout",
        help="run a demo through vmagent shards -> VictoriaMetrics <- vmalert -> Alertmanager",
    )
    p.add_argument("--shards", type=int, default=2, help="vmagent scraper shards")
    p.add_argument("--nproc", type=int, default=4, help="demo ranks")
    p.add_argument("--steps", type=int, default=120, help="demo steps")
    p.add_argument("--step-delay", type=float, default=0.2, help="seconds per step")
    p.add_argument(
        "--inject", action="append", default=None, metavar="SPEC",
        help="demo fault (repeatable; default nan@rank1:step30, fp32 so nothing absorbs it)",
    )
    p.add_argument("--scrape-interval", default="1s", help="the shards' scrape interval")
    p.add_argument("--eval-interval", default="1s", help="vmalert's evaluation interval")
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="YAML file overriding MixinConfig fields for the rules vmalert evaluates",
    )
    p.add_argument(
        "--linger", type=float, default=15.0,
        help="seconds to keep the path up after the run, for the last pages",
    )
    p.set_defaults(func=run)


class _Receiver(AlertPrinter):
    """Alertmanager webhook: prints one line per alert and keeps it for the summary."""

    prefix = "  "
    received: list[dict[str, Any]] = []


def _demo_command(args: argparse.Namespace, sd_dir: Path, run_dir: Path, port: int) -> list[str]:
    injects = args.inject if args.inject is not None else ["nan@rank1:step30"]
    cmd = [
        sys.executable, "-m", "ddpmon.cli", "demo", "--nproc", str(args.nproc),
        "--steps", str(args.steps), "--step-delay", str(args.step_delay),
        "--port", str(port), "--run-dir", str(run_dir), "--run-id", RUN_ID,
        "--sd-dir", str(sd_dir), "--no-progress", "--no-amp", "--hold", "3",
    ]
    for spec in injects:
        cmd += ["--inject", spec]
    return cmd


def _free_block(count: int) -> int:
    """A base port with ``count`` consecutive ports free on 127.0.0.1 (rank r serves base+r)."""

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(200):
        base = random.randrange(20000, 30000)
        if all(free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in 20000-30000")


def scale_figures() -> list[str]:
    """The headline of every ``## Dashboards at N ranks`` section of benchmarks/RESULTS.md (the
    checkout's), so the scale figures are printed next to the live path."""
    from ddpmon.mixin import shipped  # loaded when the command runs: a light CLI start

    root = shipped.checkout_root()
    results = root / "benchmarks" / "RESULTS.md" if root else None
    if results is None or not results.is_file():
        return ["(benchmarks/RESULTS.md is not in this installation)"]
    out = []
    text = results.read_text(encoding="utf-8")
    for m in re.finditer(r"^## (Dashboards at (\d+) ranks.*)$", text, re.M):
        body = text[m.end():].split("\n## ", 1)[0]
        series = re.search(r"\*\*Series: ([^*]+)\*\*", body)
        slowest = re.search(r"\*\*Slowest query: ([^*]+)\*\*", body)
        # The heading after "Dashboards at N ranks": any qualifier (the store, the profile).
        # "on VictoriaMetrics (series_profile=large)" -> "VictoriaMetrics, series_profile=large"
        qualifier = m.group(1).split(" ranks", 1)[1].strip().removeprefix("on ")
        qualifier = qualifier.replace(" (", ", ").replace("(", "").replace(")", "")
        out.append(
            f"{int(m.group(2)):,} ranks: series {series.group(1) if series else '?'}; "
            f"slowest panel {slowest.group(1) if slowest else '?'}"
            + (f" ({qualifier})" if qualifier else "")
        )
    return out or ["(no dashboard scale section in benchmarks/RESULTS.md)"]


def pages_summary(received: list[dict[str, Any]]) -> list[str]:
    """The final alert printout: one line per firing alert (Alertmanager re-sends a group's
    alerts with every change), each cleaned for the terminal (``AlertPrinter`` kept only dicts
    with dict labels and annotations)."""
    pages = {
        json.dumps(a["labels"], sort_keys=True, default=str): a
        for a in received if a.get("status") == "firing"
    }.values()
    lines = [f"alerts notified: {len(pages)}"]
    for alert in pages:
        labels, notes = alert["labels"], alert["annotations"]
        lines.append("  " + clean_line(f"{labels.get('alertname')}: "
                                       f"{notes.get('description', '')}"))
    return lines


def _rank_order(rank: str) -> tuple[int, str]:
    """Ranks in numeric order; a label that is not a number (whoever served it) goes last."""
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def run(args: argparse.Namespace) -> int:  # noqa: C901 - one linear script, printed as it goes
    # loaded when the command runs: a light CLI start
    from ddpmon.mixin.config import MixinConfig, load_config
    from ddpmon.services import ScaleOut, StackError

    try:
        cfg = load_config(args.config) if args.config else MixinConfig()
    except ValueError as exc:
        print(f"ddpmon scaleout: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {
        s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)
    }
    _Receiver.received = []
    hook = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    workdir = tempfile.TemporaryDirectory(prefix="ddpmon-scaleout-")
    base = Path(workdir.name)
    sd_dir = base / "sd"
    sd_dir.mkdir()
    path = demo = None
    try:
        path = ScaleOut(
            base / "path", sd_dir=sd_dir, webhook_url=f"http://127.0.0.1:{hook.server_address[1]}",
            config=cfg, shards=args.shards, scrape_interval=args.scrape_interval,
            evaluation_interval=args.eval_interval, group_wait="2s", group_interval="5s",
        )
        path.start()
        print(f"store        VictoriaMetrics {path.store.url}  (Prometheus API, vmui at /vmui)")
        for shard in path.shards:
            print(f"shard {shard.shard}      vmagent {shard.url}  hashmod {shard.shard} of "
                  f"{args.shards} -> remote_write {shard.remote_write_url}")
        print(f"ruler        vmalert {path.ruler.url}  ({len(path.rule_files)} rule files, "
              f"every {args.eval_interval}) -> {path.alertmanager.url}")
        print(f"data         {workdir.name} (removed on exit)", flush=True)
        port = _free_block(args.nproc)
        cmd = _demo_command(args, sd_dir, base / "runs", port)
        print(f"\nrunning: ddpmon demo --nproc {args.nproc} --steps {args.steps} "
              f"{' '.join(c for c in cmd if c.startswith(('nan@', 'kill@', 'inf@')))}", flush=True)
        with open(base / "demo.log", "wb") as log:
            demo = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        split: dict[int, set[str]] = {}
        while demo.poll() is None and not stop.wait(1.0):
            for shard in path.shards:
                ranks = {clean_line(t["labels"].get("rank", "?")) for t in shard.targets()
                         if t["labels"].get("run") == RUN_ID}
                if ranks - split.get(shard.shard, set()):
                    split.setdefault(shard.shard, set()).update(ranks)
                    print(f"  shard {shard.shard} scrapes rank(s) "
                          f"{', '.join(sorted(split[shard.shard], key=_rank_order))}", flush=True)
            if path.exited():
                print(f"ddpmon scaleout: {', '.join(path.exited())} exited", file=sys.stderr)
                return 1
        print(f"\ndemo exited ({demo.poll()}); keeping the path up {args.linger:g}s for the "
              "last evaluations and pages", flush=True)
        stop.wait(args.linger)
        path.store.flush()
        stored = path.store.query(
            f'count by (rank) (max_over_time(ddpmon_step{{run="{RUN_ID}"}}[1h]))'
        )
        ranks = sorted((clean_line(r["metric"].get("rank", "?")) for r in stored),
                       key=_rank_order)
        print(f"\nin VictoriaMetrics: rank(s) {', '.join(ranks) or 'none'} of {args.nproc}")
        world = path.store.query(
            f'max_over_time(run:ddpmon_world_size:max{{run="{RUN_ID}"}}[1h])'
        )
        print(f"recorded by vmalert, written back: run:ddpmon_world_size:max = "
              f"{clean_line(world[0]['value'][1]) if world else 'none'}")
        errors = [clean_line(f"{g['name']}/{r['name']}: {r['lastError']}")
                  for g in path.ruler.groups() for r in g["rules"] if r.get("lastError")]
        print(f"rule groups: {len(path.ruler.groups())}, rules with errors: {len(errors)}"
              + (f" ({'; '.join(errors[:3])})" if errors else ""))
        for line in pages_summary(_Receiver.received):
            print(line)
        print("\ndashboards at scale (benchmarks/RESULTS.md; target: every panel <= 1 s):")
        for line in scale_figures():
            print(f"  {line}")
        return 0 if len(ranks) == args.nproc and not errors else 1
    except StackError as exc:  # may quote a service's log: cleaned like every outside text

        print(f"ddpmon scaleout: {clean(exc)}", file=sys.stderr)
        return 1
    finally:
        if demo is not None and demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)
            try:
                demo.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait(timeout=5)
        if path is not None:
            path.stop()
        hook.shutdown()
        hook.server_close()
        workdir.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("scale-out path stopped", flush=True)
