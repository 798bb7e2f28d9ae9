"""The tiny model's host cost against the first agent's, side by side in one run (issue 52's
target: <= 0.30x).

The first agent is the commit that introduced the agent (``FIRST_AGENT``, "Agent: sync-free
probes ..."), taken from this repository's history with ``git archive`` into a temporary
directory. Each round runs ``benchmarks/host_cost.py`` (this checkout's harness) once for that
agent and once for this checkout (``PYTHONPATH`` picks the agent), in a shuffled order, and
reads the training-thread agent cost per step of each. The ratio is this checkout's cost over
the first agent's in the same round; the report gives its median and range over the rounds,
and both costs' medians. A machine shared with other work moves both alike within a round,
not across rounds, which is why the ratio is taken per round.

Usage: python benchmarks/host_cost_vs_first.py [--rounds N] [--commit SHA] [--write FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import write_section
from side_by_side import ROOT, extract, host_cost_figures, per_round, run_harness

FIRST_AGENT = "d7e8343"
"""The commit that introduced the agent (its first version, issue 52's reference)."""
TARGET = 0.30


def one_run(pythonpath: Path, rounds: int, block: int) -> tuple[int, int]:
    """(unmonitored step, agent cost) in us on the training thread, from one host_cost.py run."""
    step, _, cost = host_cost_figures(run_harness(
        "host_cost.py", ["--rounds", str(rounds), "--block", str(block)], pythonpath, timeout=900
    ))
    return step, cost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inner-rounds", type=int, default=6, help="host_cost.py --rounds")
    p.add_argument("--block", type=int, default=300, help="host_cost.py --block")
    p.add_argument("--commit", default=FIRST_AGENT)
    p.add_argument("--write", default=None)
    args = p.parse_args()
    costs: dict[str, list[int]] = {"first": [], "this": []}
    steps: dict[str, list[int]] = {"first": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            extract(args.commit, Path(tmp))
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"skipped: the first agent ({args.commit}) cannot be taken from git here: {exc}")
            return 0
        paths = {"first": Path(tmp), "this": ROOT}
        for _ in range(args.rounds):
            order = list(paths)
            random.shuffle(order)
            for name in order:
                step, cost = one_run(paths[name], args.inner_rounds, args.block)
                steps[name].append(step)
                costs[name].append(cost)
            print(f"round: first {costs['first'][-1]} us, this {costs['this'][-1]} us",
                  flush=True)
    ratios = per_round(costs["this"], costs["first"])
    ratio = statistics.median(ratios)
    section = "\n".join([
        "## Host cost against the first agent (tiny model, side by side)",
        "",
        f"Command: `python benchmarks/host_cost_vs_first.py --rounds {args.rounds} "
        f"--inner-rounds {args.inner_rounds} --block {args.block}` (`make bench`)  ",
        f"Each round runs `host_cost.py --rounds {args.inner_rounds} --block {args.block}` for "
        f"the first agent (commit {args.commit}) and for this checkout, in a shuffled order; "
        "the figure is the training thread's agent cost per step (monitored minus unmonitored "
        "CPU time). Ratio: this checkout's cost over the first agent's in the same round.",
        "",
        "| agent | cost per step (median, range) | unmonitored step (median) |",
        "|---|---|---|",
        *(
            f"| {label} | {statistics.median(costs[k]):.0f} us ({min(costs[k])}-"
            f"{max(costs[k])}) | {statistics.median(steps[k]):.0f} us |"
            for k, label in (("first", f"first agent ({args.commit})"), ("this", "this checkout"))
        ),
        "",
        f"**This checkout / first agent: {ratio:.2f}x** (per round {min(ratios):.2f}-"
        f"{max(ratios):.2f}x, {len(ratios)} rounds); target <= {TARGET:.2f}x: "
        f"{'met' if ratio <= TARGET else 'not met'}. Machine load (1 min) at the end: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
    ])
    print(section)
    if args.write:
        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
