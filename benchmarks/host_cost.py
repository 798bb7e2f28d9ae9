"""Absolute host cost of the agent per step, where steps are short and the host is the
bottleneck (small models, RL, CUDA-graph training): a plain 8-layer 64-wide MLP, one process,
one thread, 32 x 64 batch, SGD. The monitored and the unmonitored replica run interleaved in
blocks; time is the thread's CPU time (``time.thread_time``), so other processes on a shared
machine distort it less than wall time. Reports the median per-step difference (us) and the
RSS growth over the run.

Usage: python benchmarks/host_cost.py [--rounds N] [--block N] [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--block", type=int, default=500)
    p.add_argument("--write", default=None)
    args = p.parse_args()
    import torch

    import ddpmon

    torch.set_num_threads(1)
    x = torch.randn(32, 64)
    off = build()
    on = build()
    with tempfile.TemporaryDirectory() as tmp:
        mon = ddpmon.attach(*on, port=0, run_dir=tmp, run_id="host-cost")

        def block(model, opt, observe) -> float:
            start = time.thread_time()
            for _ in range(args.block):
                loss = model(x).pow(2).mean()
                if observe:
                    mon.observe_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
            return (time.thread_time() - start) / args.block

        block(*off, False)
        block(*on, True)
        rss_start = rss_bytes()
        base, agent = [], []
        for i in range(args.rounds):
            for which in ("off", "on") if i % 2 == 0 else ("on", "off"):
                if which == "off":
                    base.append(block(*off, False))
                else:
                    agent.append(block(*on, True))
        rss_growth = rss_bytes() - rss_start
        mon.close()
    diffs = [(a - b) * 1e6 for a, b in zip(agent, base, strict=True)]
    q = statistics.quantiles(diffs, n=4)
    steps = args.rounds * args.block
    section = "\n".join(
        [
            "## Agent host cost per step (tiny model, one process)",
            "",
            f"Command: `python benchmarks/host_cost.py --rounds {args.rounds} --block "
            f"{args.block}` (`make bench`)  ",
            "Model: 8 x Linear(64, 64) + ReLU, batch 32 x 64, SGD, 1 thread, CPU; monitored and "
            f"unmonitored replicas interleaved in blocks of {args.block} steps, {steps} steps "
            "each; thread CPU time.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| unmonitored step | {statistics.median(base) * 1e6:.0f} us |",
            f"| monitored step | {statistics.median(agent) * 1e6:.0f} us |",
            f"| agent cost per step (median, quartiles) | {statistics.median(diffs):.0f} us "
            f"({q[0]:.0f}-{q[2]:.0f} us) |",
            f"| RSS growth over {steps} monitored steps | {rss_growth / 1e6:+.1f} MB |",
            f"| machine load (1 min) at the end | {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores |",
            "",
        ]
    )
    print(section)
    if args.write:
        from overhead import write_section

        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
