"""What the straggler attribution's step split (``ddpmon.agent.step_split``) adds to a monitored
step, side by side: the same monitored loop (host_cost.py's 8-layer 64-wide MLP, one thread,
32 x 64 batch, SGD) with the split on, and with it replaced by a no-op, interleaved in blocks.
Reported as the median per-step difference of the training thread's CPU time (us) and as a share
of the monitored step, where the host is the bottleneck (the worst case: short steps); and the
split's own calls timed alone (one step's worth), which a loaded machine blurs far less.

Usage: python benchmarks/step_split_cost.py [--rounds N] [--block N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_cost import build  # noqa: E402  (a script beside this one)


class NoSplit:
    """The split's interface, doing nothing."""

    def forward_started(self) -> None: ...
    def forward_ended(self) -> None: ...
    def backward_ended(self) -> None: ...
    def optimizer_started(self) -> None: ...
    def finish(self, duration, data_wait):  # noqa: ANN001, ANN201
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block", type=int, default=200)
    args = p.parse_args()
    import torch

    import ddpmon

    torch.set_num_threads(1)
    model, opt = build()
    x = torch.randn(32, 64)
    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpmon.attach(model, opt, port=0, run_dir=run_dir, run_id="split-cost")
        pipeline = mon.flow
        real, off = pipeline.split, NoSplit()

        def block() -> float:
            start = time.thread_time()
            for _ in range(args.block):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
            return (time.thread_time() - start) / args.block

        pipeline.split = real
        block()  # warm-up
        with_split, without = [], []
        for _ in range(args.rounds):
            pipeline.split = real
            with_split.append(block())
            pipeline.split = off
            without.append(block())
        pipeline.split = real
        mon.close()
    direct = _direct_cost(real)
    diffs = [a - b for a, b in zip(with_split, without, strict=True)]
    step = statistics.median(with_split)
    added = statistics.median(diffs)
    print(f"monitored step, training-thread CPU: {step * 1e6:.1f} us (median of {args.rounds} "
          f"blocks of {args.block})")
    print(f"step split adds: {added * 1e6:.2f} us per step = {100 * added / step:.3f} % of it "
          f"(block differences: min {min(diffs) * 1e6:.2f}, max {max(diffs) * 1e6:.2f} us)")
    print(f"the split's own calls, timed alone: {direct * 1e6:.2f} us per step = "
          f"{100 * direct / step:.3f} % of the monitored step")
    return 0


def _direct_cost(split, steps: int = 20_000) -> float:
    """Seconds per step of the split's calls alone (one forward, backward and optimizer step)."""
    start = time.thread_time()
    for _ in range(steps):
        split.forward_started()
        split.forward_ended()
        split.backward_ended()
        split.optimizer_started()
        split.finish(0.01, 0.001)
    return (time.thread_time() - start) / steps


if __name__ == "__main__":
    raise SystemExit(main())
