"""Absolute host cost of the agent per step, where steps are short and the host is the
bottleneck (small models, RL, CUDA-graph training): a plain 8-layer 64-wide MLP, one process,
one torch thread, 32 x 64 batch, SGD. The monitored and the unmonitored replica run interleaved
in blocks. Three clocks per block, each reported as the median per-step difference (us):

- training-thread CPU time (``time.thread_time``): what the agent adds to the loop's own thread,
  the cost the step waits for;
- process CPU time (``time.process_time``, every thread): that plus the agent's record thread,
  which derives records and runs the sinks off the training thread. After each monitored block
  the benchmark lets the record thread finish that block's records before the clock stops;
- wall time of the loop.

CPU times are less distorted than wall time by other processes on a shared machine. Also
reports the RSS growth over the run.

With ``--block-entry``, a third kind of block joins the interleaving: the monitored replica with
the tensor-parallel NaN-entry check (``strategies.block_entry``: a hook on each of the 16
top-level modules, one ``isfinite().all()`` per output gradient) installed for that block and
removed after it. Its cost is reported as that block minus the monitored block beside it.

Usage: python benchmarks/host_cost.py [--rounds N] [--block N] [--block-entry]
       [--write benchmarks/RESULTS.md]
Another version of the agent in the same harness: ``PYTHONPATH=<its checkout> python ...``.
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
    p.add_argument("--rounds", type=int, default=60,
                   help="blocks of each kind, interleaved (2 at least: quartiles need two)")
    p.add_argument("--block", type=int, default=500)
    p.add_argument("--write", default=None)
    p.add_argument("--block-entry", action="store_true")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be 2 or more (the figures are quartiles over the rounds)")
    import torch

    import ddpmon

    torch.set_num_threads(1)
    x = torch.randn(32, 64)
    off = build()
    on = build()
    with tempfile.TemporaryDirectory() as tmp:
        mon = ddpmon.attach(*on, port=0, run_dir=tmp, run_id="host-cost")

        def block(model, opt, observe) -> tuple[float, float, float]:
            """Per-step (thread CPU, process CPU, wall) seconds over one block."""
            thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(args.block):
                loss = model(x).pow(2).mean()
                if observe:
                    mon.observe_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
            wall = time.perf_counter() - wall
            if observe:
                time.sleep(0.15)  # the record thread drains the block (sleeping costs no CPU)
                flush = getattr(mon, "flush", None)  # absent before the record thread
                if flush is not None:
                    flush()  # whatever it has not reached yet, counted on this thread
            n = args.block
            return (
                (time.thread_time() - thread) / n,
                (time.process_time() - process) / n,
                wall / n,
            )

        def entry_block() -> tuple[float, float, float]:
            from ddpmon.strategies.block_entry import BlockEntry

            flow = getattr(mon, "flow", None) or mon.pipeline  # mon.pipeline before its rename
            entry = flow.entry = BlockEntry.install(on[0], mon.guard.error)
            try:
                return block(*on, True)
            finally:
                entry.close()
                flow.entry = None

        block(*off, False)
        block(*on, True)
        rss_start = rss_bytes()
        base, agent, entry = [], [], []
        kinds = ("off", "on", "entry") if args.block_entry else ("off", "on")
        for i in range(args.rounds):
            for which in kinds if i % 2 == 0 else kinds[::-1]:
                if which == "off":
                    base.append(block(*off, False))
                elif which == "on":
                    agent.append(block(*on, True))
                else:
                    entry.append(entry_block())
        rss_growth = rss_bytes() - rss_start
        mon.close()
    def cost(clock: int, agent=agent, base=base) -> tuple[float, float, float]:
        """Median and quartiles (us) of the per-step monitored-minus-unmonitored difference."""
        diffs = [(a[clock] - b[clock]) * 1e6 for a, b in zip(agent, base, strict=True)]
        q = statistics.quantiles(diffs, n=4)
        return statistics.median(diffs), q[0], q[2]

    def median_us(blocks: list, clock: int) -> float:
        return statistics.median(b[clock] for b in blocks) * 1e6

    thread, process, wall = cost(0), cost(1), cost(2)
    steps = args.rounds * args.block
    section = "\n".join(
        [
            "## Agent host cost per step (tiny model, one process)",
            "",
            f"Command: `python benchmarks/host_cost.py --rounds {args.rounds} --block "
            f"{args.block}` (`make bench`)  ",
            "Model: 8 x Linear(64, 64) + ReLU, batch 32 x 64, SGD, 1 torch thread, CPU; "
            f"monitored and unmonitored replicas interleaved in blocks of {args.block} steps, "
            f"{steps} steps each. Agent cost = monitored minus unmonitored, per step: median "
            "(quartiles) over the block pairs.",
            "",
            "| clock | unmonitored step | monitored step | agent cost per step |",
            "|---|---|---|---|",
            *(
                f"| {name} | {median_us(base, i):.0f} us | {median_us(agent, i):.0f} us | "
                f"**{c[0]:.0f} us** ({c[1]:.0f}-{c[2]:.0f}) |"
                for i, (name, c) in enumerate(
                    (
                        ("training-thread CPU", thread),
                        ("process CPU (all threads)", process),
                        ("wall", wall),
                    )
                )
            ),
            "",
            "| figure | value |",
            "|---|---|",
            f"| training-thread cost relative to the unmonitored step | "
            f"{thread[0] / median_us(base, 0):.0%} (issue 10's target, 100 us on a 248 us "
            "step: 40%) |",
            f"| RSS growth over {steps} monitored steps | {rss_growth / 1e6:+.1f} MB |",
            f"| machine load (1 min) at the end | {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores |",
            "",
        ]
    )
    if entry:
        section += "\n".join([
            "",
            "Tensor-parallel NaN-entry check (`--block-entry`): the monitored replica with "
            "`strategies.block_entry` on its 16 top-level modules, minus the monitored replica "
            "beside it, per step: median (quartiles).",
            "",
            "| clock | monitored step | with the entry check | entry check per step |",
            "|---|---|---|---|",
            *(
                f"| {name} | {median_us(agent, i):.0f} us | {median_us(entry, i):.0f} us | "
                f"**{c[0]:.0f} us** ({c[1]:.0f}-{c[2]:.0f}) |"
                for i, name in enumerate(("training-thread CPU", "process CPU (all threads)",
                                          "wall"))
                for c in (cost(i, entry, agent),)
            ),
            "",
        ])
    print(section)
    if args.write:
        from overhead import write_section

        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
