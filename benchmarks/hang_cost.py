"""What live hang naming (issue 48, docs/slow-and-stuck/hangs.md) adds to a step, side by side.

One process, one torch thread, the host_cost.py model (8 x Linear(64, 64), 32 x 64 batch,
SGD), where steps are shortest and the host cost shows most. One monitored loop runs blocks
in alternation:

- ``with``: the agent as shipped: the phase's wall time kept at each phase change, the loop
  inside ``mon.phase("train")``, and a scrape's read of the rank's activity every ``--scrape``
  steps (in the loop's thread, so its cost is counted in the step: a pessimistic bound; a real
  scrape runs on the endpoint's thread every 15 s);
- ``without``: the same agent with the phase's wall time not kept (``StepPhase._at`` as it was
  before issue 48), no ``mon.phase`` and no activity read.

Reported: the median over blocks of the per-step training-thread CPU time (``thread_time``)
and wall time of each, and the difference as a share of the step. A loaded machine cannot
resolve a few microseconds in a millisecond step that way, so the two parts are also timed
alone, in tight loops: ``StepPhase._at`` shipped against before (per phase change; a step has
four) and one activity read (per scrape), each as a share of the median step. Usage:
``python benchmarks/hang_cost.py [--rounds N] [--block N] [--scrape N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=300)
    p.add_argument("--scrape", type=int, default=1, help="read the activity every N steps")
    args = p.parse_args()

    import torch
    from host_cost import build

    import ddpmon
    from ddpmon.agent.step_phase import StepPhase

    torch.set_num_threads(1)
    model, opt = build()
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    shipped_at = StepPhase._at

    def old_at(self, phase: int) -> None:  # StepPhase._at before issue 48
        self.phase = phase
        self.live.set(self.step, phase)

    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpmon.attach(model, opt, port=0, run_dir=run_dir, run_id="hang-cost")

        def block(on: bool) -> tuple[float, float]:
            StepPhase._at = shipped_at if on else old_at
            marked = mon.phase("train") if on else contextlib.nullcontext()
            t0, c0 = time.perf_counter(), time.thread_time()
            with marked:
                for i in range(args.block):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    mon.observe_loss(loss)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if on and i % args.scrape == 0:
                        mon.activity.samples()
            c1, t1 = time.thread_time(), time.perf_counter()
            mon.flush()
            return (c1 - c0) / args.block, (t1 - t0) / args.block

        block(True), block(False)  # warm-up
        cpu = {True: [], False: []}
        wall = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 else (False, True)):
                c, w = block(on)
                cpu[on].append(c)
                wall[on].append(w)
        StepPhase._at = shipped_at
        mon.close()

    step = statistics.median(cpu[False])
    print(f"hot path: StepPhase._at {_per_call(shipped_at) * 1e9:.0f} ns against "
          f"{_per_call(old_at) * 1e9:.0f} ns before; 4 phase changes a step add "
          f"{4 * (_per_call(shipped_at) - _per_call(old_at)) / step * 100:.4f} % of the step")
    read = _activity_read()
    print(f"scrape: one activity read {read * 1e6:.1f} us (a scrape thread's, every 15 s)")
    for name, clock in (("thread CPU", cpu), ("wall", wall)):
        with_, without = statistics.median(clock[True]), statistics.median(clock[False])
        diffs = sorted(a - b for a, b in zip(clock[True], clock[False], strict=True))
        print(f"{name}: with {with_ * 1e6:.1f} us/step, without {without * 1e6:.1f} us/step, "
              f"median paired difference {statistics.median(diffs) * 1e6:+.2f} us/step "
              f"({statistics.median(diffs) / without * 100:+.3f} % of the step; quartiles "
              f"{diffs[len(diffs) // 4] * 1e6:+.2f} to {diffs[3 * len(diffs) // 4] * 1e6:+.2f} us)")


def _per_call(at, n: int = 200_000) -> float:
    """Thread CPU seconds of one ``_at`` call on a bare phase holder (median of 5)."""
    from types import SimpleNamespace

    from ddpmon.recorder.live_step import NO_LIVE

    holder = SimpleNamespace(phase=0, step=0, live=NO_LIVE, phase_since=0.0)
    runs = []
    for _ in range(5):
        t = time.thread_time()
        for i in range(n):
            at(holder, 68 + (i & 3))  # a change every call
        runs.append((time.thread_time() - t) / n)
    return statistics.median(runs)


def _activity_read(n: int = 20_000) -> float:
    import threading
    from types import SimpleNamespace

    from ddpmon.agent.activity import Activity

    pipeline = SimpleNamespace(phase=68, phase_since=time.time(), loop_phase=None)
    activity = Activity(pipeline, lambda: 5, time.time, 30.0, threading.get_ident(),
                        read_recorder=dict)
    t = time.thread_time()
    for _ in range(n):
        activity.samples()
    return (time.thread_time() - t) / n


if __name__ == "__main__":
    main()
