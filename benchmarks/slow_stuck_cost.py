"""What straggler attribution and live hang naming (issue 48) add to a step, side by side, finely
enough to resolve its 0.2 % goal on a shared machine.

One process, one torch thread, one monitored loop (8 x Linear(W, W) + ReLU, a 32 x W batch, MSE
loss, SGD: host_cost.py's loop at width W) inside ``mon.phase("train")``. Steps alternate
between two settings of the same agent, one step at a time, in ABBA order (on, off, off, on,
...), so that whatever the machine does to one setting it does to the other within a few
milliseconds:

- ``on``: the agent as shipped: the step split (``agent.step_split``: a clock read and a few
  additions at forward start, forward end, backward end, optimizer start and step close) and
  the phase's wall time kept at each phase change (``StepPhase._at``, what a scrape reads for
  hang naming);
- ``off``: the same agent with the split replaced by a no-op and ``StepPhase._at`` as it was
  before issue 48. There is no switch for these parts: swapping the two objects is the least
  change that runs the loop without them (both are set before every step, in either setting).

Each step is timed on its own with the training thread's CPU clock (``time.thread_time``: what
the step waits for, blind to other processes' time on the CPU) and with the wall clock. The
figure is the median of the paired differences (on minus off, the two steps of each half of an
ABBA quartet) as a share of the median ``off`` step, with a bootstrap 95 % interval (resampled
pairs); the interval's half-width is the resolution reached. A loaded machine inflates single
steps (a preemption pollutes the caches): the median of many pairs is robust to those.

Not in the interleaved loop, added from timings alone (tight loops; the same parts as
step_split_cost.py and hang_cost.py): a scrape's read of the rank's activity (on the endpoint's
thread, once per scrape interval, 15 s by default: its share of a step is that read over the
steps in 15 s), and the issue clock around each collective call (``probes.comm_issue``:
collectives run only with several ranks; per call, times the calls a step makes). The record
thread's work on the phases (off the training thread) is not counted.
``--wall-split`` adds a diagnostic run: the split reading the wall clock instead of the thread's
CPU clock (a system call on Linux), to see what those reads cost inside the loop.
Usage: ``python benchmarks/slow_stuck_cost.py [--widths 64 256] [--pairs N] [--control]
[--wall-split] [--write FILE]``.
"""

from __future__ import annotations

import argparse
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
from overhead import write_section  # noqa: E402
from side_by_side import uptime  # noqa: E402

import ddpmon  # noqa: E402
from ddpmon.agent.step_phase import StepPhase  # noqa: E402
from ddpmon.probes.comm_issue import IssueClock  # noqa: E402

TARGET = 0.002
"""Issue 48's cost goal: 0.2 % of step time."""
SCRAPE_S = 15.0
"""The scrape interval the activity read is amortised over (Prometheus' usual)."""


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


def paired_median(on: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Median of the paired differences (rows of resampled pairs: one figure per row)."""
    return torch.quantile(on - off, 0.5, dim=-1)


def low_quantile(on: torch.Tensor, off: torch.Tensor, q: float = 0.1) -> torch.Tensor:
    """The 10th percentile of the ``on`` steps less that of the ``off`` steps: the steps the
    machine disturbed least (a preemption only lengthens a step), so the least noisy figure."""
    return torch.quantile(on, q, dim=-1) - torch.quantile(off, q, dim=-1)


def bootstrap(on: list[float], off: list[float], estimator, resamples: int = 1000,
              seed: int = 0) -> tuple[float, float, float]:
    """``estimator`` of the pairs and a bootstrap 95 % interval of it (pairs resampled with
    replacement, the two steps of a pair together)."""
    a, b = torch.tensor(on, dtype=torch.float64), torch.tensor(off, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    boots = torch.cat([
        estimator(a[idx], b[idx])
        for idx in (torch.randint(len(a), (50, len(a)), generator=gen)
                    for _ in range(resamples // 50))
    ]).sort().values
    lo, hi = boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]
    return float(estimator(a, b)), float(lo), float(hi)


def measure(width: int, pairs: int, control: bool = False, wall_split: bool = False,
            flush_every: int = 100) -> dict:
    """Per-step thread CPU and wall seconds of ``pairs`` on/off pairs at ``width``; with
    ``control``, ``off`` is ``on`` too (the same swaps, nothing removed: the method's noise);
    with ``wall_split``, the split reads the wall clock (``perf_counter``, no system call)
    instead of the thread's CPU clock it uses on CPU: what those reads cost in the loop."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, width), torch.randn(32, width)
    shipped_at = StepPhase._at
    cpu: dict[bool, list[float]] = {True: [], False: []}
    wall: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpmon.attach(model, opt, port=0, run_dir=run_dir, run_id=f"cost-{width}")
        pipeline = mon.flow
        split = pipeline.split
        if wall_split:
            split._clock = time.perf_counter  # the diagnostic's one change (a private field)
        no_split = split if control else NoSplit()
        off_at = shipped_at if control else old_at

        def step(on: bool) -> None:
            StepPhase._at = shipped_at if on else off_at
            pipeline.split = split if on else no_split
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            c1, t1 = time.thread_time(), time.perf_counter()
            cpu[on].append(c1 - c0)
            wall[on].append(t1 - t0)

        try:
            with mon.phase("train"):
                for i in range(20):  # warm-up, both settings
                    step(i % 2 == 0)
                mon.flush()
                for on in cpu:
                    cpu[on].clear()
                    wall[on].clear()
                for i in range(pairs):
                    order = (True, False) if i % 2 == 0 else (False, True)  # ABBA
                    for on in order:
                        step(on)
                    if i % flush_every == flush_every - 1:
                        mon.flush()  # the record thread's queue drained, between pairs
        finally:
            StepPhase._at = shipped_at
            pipeline.split = split
            mon.close()
    out: dict = {"width": width, "pairs": pairs, "control": control, "wall_split": wall_split,
                 "split_s": step_split_cost._direct_cost(split)}
    for name, clock in (("cpu", cpu), ("wall", wall)):
        off = torch.tensor(clock[False], dtype=torch.float64)
        out[name] = {"step_us": float(off.median()) * 1e6,
                     "clean_us": float(off.quantile(0.1)) * 1e6}
        for est, fn, ref in (("median", paired_median, out[name]["step_us"]),
                             ("low", low_quantile, out[name]["clean_us"])):
            mid, lo, hi = bootstrap(clock[True], clock[False], fn)
            out[name][est] = {"us": mid * 1e6, "ci_us": (lo * 1e6, hi * 1e6),
                              "share": mid * 1e6 / ref, "ci": (lo * 1e6 / ref, hi * 1e6 / ref)}
    return out


def issue_clock_cost(n: int = 20_000) -> float:
    """Thread CPU seconds of the issue clock around one collective call (begin and end)."""
    clock = IssueClock()
    runs = []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(n):
            clock.end(clock.begin())
        runs.append((time.thread_time() - t) / n)
    return statistics.median(runs)


def parts_alone(split_s: float) -> dict[str, float]:
    """Seconds of each part timed alone: per step (split, four phase changes), per scrape
    (activity read), per collective call (issue clock)."""
    return {
        "split": split_s,
        "phases": 4 * (hang_cost._per_call(StepPhase._at) - hang_cost._per_call(old_at)),
        "read": hang_cost._activity_read(),
        "issue": issue_clock_cost(),
    }


def pct(share: float) -> str:
    return f"{share * 100:+.3f} %"


def section(results: list[dict], parts: dict[str, float], loads: list[str], cmd: str) -> str:
    rows = []
    for res in results:
        setting = ("control (on vs on)" if res["control"] else
                   "on (split on the wall clock) vs off" if res["wall_split"] else "on vs off")
        for name, label in (("cpu", "thread CPU"), ("wall", "wall")):
            r = res[name]
            for est, ref in (("low", "clean_us"), ("median", "step_us")):
                e = r[est]
                lo, hi = e["ci"]
                rows.append(
                    f"| {res['width']} | {setting} | {label} | "
                    f"{'10th percentiles' if est == 'low' else 'paired median'} | "
                    f"{r[ref]:.0f} us | **{pct(e['share'])}** ({e['us']:+.1f} us) | "
                    f"{pct(lo)} to {pct(hi)} | ±{(hi - lo) / 2 * 100:.2f} % | {res['pairs']} |"
                )
    alone = []
    for res in results:
        if res["control"] or res["wall_split"]:
            continue
        width, step = res["width"], res["cpu"]["clean_us"] / 1e6
        total = parts["split"] + parts["phases"] + parts["read"] / max(SCRAPE_S / step, 1.0)
        alone.append(f"| {width} | {total * 1e6:.2f} us | {total / step * 100:.3f} % | "
                     f"{parts['issue'] * 1e6:.2f} us ({parts['issue'] / step * 100:.3f} % of "
                     "this step per call) |")
    return "\n".join([
        "## Straggler split and hang tracking, side by side (issue 48's 0.2 %)",
        "",
        f"Command: `{cmd}`  ",
        "One process, one torch thread, 8 x Linear(W, W) + ReLU, batch 32 x W, MSE, SGD, inside "
        "`mon.phase(\"train\")`. Steps alternate one by one in ABBA order between the agent as "
        "shipped (`on`) and the same agent with the step split a no-op and `StepPhase._at` as "
        "before issue 48 (`off`); each step timed alone. Two figures, each with a bootstrap 95 % "
        "interval (1,000 resamples of the pairs; its half-width is the resolution): the 10th "
        "percentile of the `on` steps less that of the `off` steps, over the `off` steps' 10th "
        "percentile (the clean step: the steps the machine disturbed least), and the median of "
        "the paired on-minus-off differences over the median `off` step. The control row runs "
        "`on` against `on` with the same swaps: what the method reads where nothing differs.",
        "",
        "| W | setting | clock | figure | step | added | 95 % interval | resolution | pairs |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Parts timed alone (tight loops): split {parts['split'] * 1e6:.2f} us a step, four "
        f"phase changes {parts['phases'] * 1e6:.3f} us a step, one activity read "
        f"{parts['read'] * 1e6:.2f} us a scrape (on the endpoint's thread, every "
        f"{SCRAPE_S:.0f} s), the issue clock {parts['issue'] * 1e6:.2f} us a collective call "
        "(several ranks only).",
        "",
        "| W | split + phases + one read per 15 s, per step | share of the clean step | issue "
        "clock per collective call |",
        "|---|---|---|---|",
        *alone,
        "",
        "Load (`uptime`) before each width and at the end:",
        "",
        *(f"- `{line}`" for line in loads),
        "",
    ])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--control", action="store_true",
                   help="also run the first width on against on (the method's noise)")
    p.add_argument("--wall-split", action="store_true",
                   help="also run the first width with the split on the wall clock (diagnostic)")
    p.add_argument("--write", default=None, help="replace/append the section in this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    cmd = (f"python benchmarks/slow_stuck_cost.py --widths {' '.join(map(str, args.widths))} "
           f"--pairs {args.pairs}{' --control' if args.control else ''}"
           f"{' --wall-split' if args.wall_split else ''}")
    first = args.widths[0]
    runs = [(w, False, False) for w in args.widths]
    runs += [(first, True, False)] if args.control else []
    runs += [(first, False, True)] if args.wall_split else []
    loads, results = [], []
    for width, control, wall_split in runs:
        loads.append(uptime())
        print(f"width {width}{' control' if control else ''}"
              f"{' wall-clock split' if wall_split else ''}: {loads[-1]}", flush=True)
        results.append(measure(width, args.pairs, control, wall_split))
    parts = parts_alone(results[0]["split_s"])
    loads.append(uptime())
    text = section(results, parts, loads, cmd)
    print(text)
    if args.write:
        write_section(Path(args.write), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
