"""What straggler attribution and live hang naming (issue 48) add to a step, together, side by side.

One process, one torch thread, one monitored loop (8 x Linear(W, W), 32 x W batch, SGD, the
way host_cost.py's loop is written), run in blocks that alternate (ABBA order):

- ``on``: the agent as shipped: the step split (``ddpmon.agent.step_split``) timing forward,
  backward and optimizer, the phase's wall time kept at each phase change (the activity a
  scrape reads for hang naming), the loop inside ``mon.phase("train")``, and the activity read
  a scrape does, in the loop's thread every ``--scrape`` steps (a pessimistic bound: a real
  scrape reads it on the endpoint's thread every 15 s);
- ``off``: the same agent with the split replaced by a no-op, ``StepPhase._at`` as before issue
  48, no ``mon.phase`` and no activity read.

Reported per width: the median over round pairs of the on/off ratio of per-step training-thread
CPU time and of wall time, with the ratios' quartiles (the spread), the added microseconds per
step, and the step time from which that addition is 0.2 % of it. ``--width 64`` is the
host-bound worst case (the shortest steps); larger widths give steps nearer real ones. A loaded
machine blurs a few microseconds in a millisecond step, so the parts are also timed alone, in
tight loops (step_split_cost.py's and hang_cost.py's): the split's calls for one step, four
phase changes shipped against before, and one activity read per 15 s (at the step time
measured), as a share of the median step.
Usage: ``python benchmarks/slow_stuck_cost.py [--widths 64 512] [--rounds N] [--block N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hang_cost  # noqa: E402  (scripts beside this one)
import step_split_cost  # noqa: E402

import ddpmon  # noqa: E402
from ddpmon.agent.step_phase import StepPhase  # noqa: E402

TARGET = 0.002
"""Issue 48's cost goal: 0.2 % of step time."""


class NoSplit:
    """The step split's interface, doing nothing."""

    def forward_started(self) -> None: ...
    def forward_ended(self) -> None: ...
    def backward_ended(self) -> None: ...
    def optimizer_started(self) -> None: ...
    def reset(self) -> None: ...
    def finish(self, duration, data_wait):  # noqa: ANN001, ANN201
        return None


def old_at(self, phase: int) -> None:
    """``StepPhase._at`` before issue 48 (no phase wall time kept)."""
    self.phase = phase
    self.live.set(self.step, phase)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def measure(width: int, rounds: int, block: int, scrape: int) -> dict:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, width), torch.randn(32, width)
    shipped_at = StepPhase._at
    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpmon.attach(model, opt, port=0, run_dir=run_dir, run_id=f"cost-{width}")
        pipeline = mon.pipeline
        split, no_split = pipeline.split, NoSplit()

        def run(on: bool) -> tuple[float, float]:
            StepPhase._at = shipped_at if on else old_at
            pipeline.split = split if on else no_split
            marked = mon.phase("train") if on else contextlib.nullcontext()
            t0, c0 = time.perf_counter(), time.thread_time()
            with marked:
                for i in range(block):
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if on and i % scrape == 0:
                        mon.activity.samples()
            c1, t1 = time.thread_time(), time.perf_counter()
            mon.flush()
            return (c1 - c0) / block, (t1 - t0) / block

        try:
            run(True), run(False)  # warm-up
            cpu: dict[bool, list[float]] = {True: [], False: []}
            wall: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds):
                for on in ((True, False) if r % 2 else (False, True)):
                    c, w = run(on)
                    cpu[on].append(c)
                    wall[on].append(w)
            split_s = step_split_cost._direct_cost(split)  # the monitor's own split, alone
        finally:
            StepPhase._at = shipped_at
            pipeline.split = split
            mon.close()
    out: dict = {"width": width, "split_s": split_s}
    for name, clock in (("cpu", cpu), ("wall", wall)):
        ratios = [a / b for a, b in zip(clock[True], clock[False], strict=True)]
        diffs = [a - b for a, b in zip(clock[True], clock[False], strict=True)]
        out[name] = {"step_us": statistics.median(clock[False]) * 1e6,
                     "ratio": quartiles(ratios), "added_us": statistics.median(diffs) * 1e6}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="+", default=[64, 512])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=200)
    p.add_argument("--scrape", type=int, default=1, help="read the activity every N steps")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} CPUs, load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{args.rounds} round pairs of {args.block} steps, activity read every "
          f"{args.scrape} step(s)")
    steps: dict[int, float] = {}
    for width in args.widths:
        res = measure(width, args.rounds, args.block, args.scrape)
        steps[width] = res["cpu"]["step_us"]
        for name in ("cpu", "wall"):
            r = res[name]
            lo, mid, hi = r["ratio"]
            print(f"width {width}, {name}: step {r['step_us']:.0f} us off; on/off median "
                  f"{(mid - 1) * 100:+.3f} % (quartiles {(lo - 1) * 100:+.3f} to "
                  f"{(hi - 1) * 100:+.3f} %), {r['added_us']:+.2f} us/step: 0.2 % of a step "
                  f"from {max(r['added_us'], 0) / TARGET / 1000:.2f} ms", flush=True)
    split = res["split_s"]
    phases = 4 * (hang_cost._per_call(StepPhase._at) - hang_cost._per_call(old_at))
    read = hang_cost._activity_read()
    print(f"parts alone, per step: split {split * 1e6:.2f} us, phase wall time "
          f"{phases * 1e6:.3f} us, activity read {read * 1e6:.1f} us per scrape")
    for width, step_us in steps.items():
        per_scrape = read / max(15.0 / (step_us / 1e6), 1.0)
        total = split + phases + per_scrape
        print(f"width {width}: {total * 1e6:.2f} us per {step_us:.0f} us step = "
              f"{total / (step_us / 1e6) * 100:.3f} % (0.2 % from {total / TARGET * 1e3:.2f} ms)")
    print(f"load after: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
