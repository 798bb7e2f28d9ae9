"""`make bench`'s overhead ratios for an older ddpmon and this checkout, side by side in one run
(issue 47: the reshape must not make monitoring dearer).

``--before REF`` (default ed0588e, the commit before issue 47's reshape) is taken from git
(``git archive REF ddpmon``) into a temporary directory. Each round runs every chosen harness
of this checkout twice, once importing that package and once this checkout's (``PYTHONPATH``),
in a shuffled order per harness, and reads each run's own side-by-side figure:

- ``host_cost``: ``host_cost.py``, the tiny MLP in one process; the figure is the monitored
  over the unmonitored training-thread CPU time per step (and the agent's cost in us);
- ``ddp``: ``overhead.py``, agent/base on the 26M transformer, 2 gloo ranks;
- ``fsdp``: ``fsdp_overhead.py``, agent/base on FSDP2, 2 gloo ranks;
- ``pp``: ``pp_overhead.py``, agent/base on GPipe with 2 stages;
- ``deepspeed``: ``deepspeed_overhead.py``, agent/base at ZeRO-2 and ZeRO-3 (not in the default
  set: one smoke-size round took 10 minutes at load 18 on 2 cores, DeepSpeed's JIT rebuilding
  an op on first load).

Per figure the report gives the older and this checkout's median with the range over rounds,
and this checkout's over the older in the same round (median and range), with the load
(``uptime``) before each round and at the end. The harnesses are this checkout's; where one
uses a module that moved, it imports either home (``fsdp_overhead.py``,
``deepspeed_overhead.py``), so all of them run against ed0588e.

Usage: python benchmarks/before_after.py [--before REF] [--rounds N]
       [--benches host_cost ddp fsdp pp deepspeed] [--quick] [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overhead import write_section
from side_by_side import (
    ROOT,
    extract,
    host_cost_figures,
    per_round,
    run_harness,
    spread,
    table_ratio,
    uptime,
)

BEFORE = "ed0588e"
"""The commit before issue 47's reshape (module moves, step-field declarations, strategies)."""


@dataclass(frozen=True)
class Harness:
    script: str
    args: list[str]
    """Full size: what ``make bench-before-after`` runs each round."""
    quick: list[str]
    """A smoke run's size (``--quick``)."""
    read: Callable[[str], dict[str, float]]
    """The figures (name -> value) of one run's printed section."""


def _host_cost(stdout: str) -> dict[str, float]:
    base, monitored, cost = host_cost_figures(stdout)
    return {"host_cost: monitored / unmonitored (thread CPU)": monitored / base,
            "host_cost: agent cost per step (us)": cost}


def _rows(*rows: tuple[str, str]) -> Callable[[str], dict[str, float]]:
    return lambda stdout: {name: table_ratio(stdout, row) for name, row in rows}


HARNESSES = {
    "host_cost": Harness("host_cost.py", ["--rounds", "6", "--block", "200"],
                         ["--rounds", "2", "--block", "50"], _host_cost),
    "ddp": Harness("overhead.py", ["--rounds", "24", "--scrape-pairs", "1", "--block", "1",
                                   "--d-model", "256", "--layers", "4"],
                   ["--rounds", "3", "--scrape-pairs", "1", "--block", "1", "--d-model", "128",
                    "--layers", "2"], _rows(("ddp: agent / base", "agent / base"))),
    "fsdp": Harness("fsdp_overhead.py", ["--rounds", "8", "--block", "4"],
                    ["--rounds", "2", "--block", "1", "--batch", "32"],
                    _rows(("fsdp: agent / base", "agent / base"))),
    "pp": Harness("pp_overhead.py", ["--rounds", "8", "--block", "4"],
                  ["--rounds", "2", "--block", "1", "--batch", "32"],
                  _rows(("pp: agent / base", "agent / base"))),
    "deepspeed": Harness("deepspeed_overhead.py", ["--rounds", "20"],
                         ["--rounds", "3", "--batch", "32"],
                         _rows(("deepspeed ZeRO-2: agent / base", "zero2"),
                               ("deepspeed ZeRO-3: agent / base", "zero3"))),
}
DEFAULT = ("host_cost", "ddp", "fsdp", "pp")


def measure(before: str, benches: list[str], rounds: int, quick: bool) -> tuple[dict, list[str]]:
    """{figure: {"old": [...], "new": [...]}} over the rounds, and the load before each round
    and at the end."""
    figures: dict[str, dict[str, list[float]]] = {}
    loads: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        extract(before, Path(tmp))
        paths = {"old": Path(tmp), "new": ROOT}
        for r in range(rounds):
            loads.append(uptime())
            print(f"round {r + 1}/{rounds}: {loads[-1]}", flush=True)
            for name in benches:
                harness = HARNESSES[name]
                order = list(paths)
                random.shuffle(order)
                for which in order:
                    stdout = run_harness(harness.script, harness.quick if quick else harness.args,
                                         paths[which])
                    for figure, value in harness.read(stdout).items():
                        figures.setdefault(figure, {"old": [], "new": []})[which].append(value)
                        print(f"  {figure} [{which}]: {value:.3f}", flush=True)
    loads.append(uptime())
    return figures, loads


def summarize(figures: dict, loads: list[str], args: argparse.Namespace) -> str:
    rows = []
    for figure, runs in figures.items():
        old, new = spread(runs["old"]), spread(runs["new"])
        ratio = spread(per_round(runs["new"], runs["old"]))
        digits = 0 if figure.endswith("(us)") else 3
        rows.append(
            f"| {figure} | {old[0]:.{digits}f} ({old[1]:.{digits}f}-{old[2]:.{digits}f}) | "
            f"{new[0]:.{digits}f} ({new[1]:.{digits}f}-{new[2]:.{digits}f}) | "
            f"**{ratio[0]:.3f}** ({ratio[1]:.3f}-{ratio[2]:.3f}) | {len(runs['new'])} |"
        )
    sizes = "; ".join(
        f"`{h.script} {' '.join(h.quick if args.quick else h.args)}`"
        for h in (HARNESSES[b] for b in args.benches)
    )
    return "\n".join([
        f"## Before and after {args.before} (make bench's ratios, side by side)",
        "",
        f"Command: `python benchmarks/before_after.py --before {args.before} --rounds "
        f"{args.rounds} --benches {' '.join(args.benches)}{' --quick' if args.quick else ''}` "
        f"(`make bench-before-after BEFORE={args.before}`)  ",
        f"Each round runs each harness of this checkout ({sizes}) twice, once importing the "
        f"`ddpmon` package of {args.before} (`git archive`) and once this checkout's, in a "
        "shuffled order; each run's figure is its own side-by-side ratio (monitored over "
        "unmonitored, in the same process or job). Older and this checkout: median (min-max) "
        "over the rounds; this / older: the ratio of the two in the same round, median "
        "(min-max).",
        "",
        f"| figure | {args.before} | this checkout | this / {args.before} | rounds |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Load (`uptime`) before each round and at the end:",
        "",
        *(f"- `{line}`" for line in loads),
        "",
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default=BEFORE, help="the older commit (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--benches", nargs="+", choices=sorted(HARNESSES), default=list(DEFAULT))
    p.add_argument("--quick", action="store_true", help="small sizes: does every harness run?")
    p.add_argument("--write", default=None, help="replace/append the section in this file")
    args = p.parse_args()
    try:
        figures, loads = measure(args.before, args.benches, args.rounds, args.quick)
    except subprocess.CalledProcessError as exc:
        print(f"{args.before} cannot be taken from git here: {exc}", file=sys.stderr)
        return 1
    section = summarize(figures, loads, args)
    print(section)
    if args.write:
        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
