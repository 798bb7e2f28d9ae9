"""Cost of the loss-spike parts (docs/loss-spikes.md): the per-group update figures at sampled
steps (``update_every``, default 10), the spike detector, and max logits, side by side with the
agent without them, in one process on the CPU.

Two identical replicas of the overhead benchmark's transformer (benchmarks/overhead.py) are
trained in the same process, one step of each per round in a shuffled order, so drift and noise
hit both alike:

  agent    ``ddpmon.attach(..., update_every=0)``: everything but the update figures
  updates  ``ddpmon.attach(..., update_every=10, logit_modules=["head"])``: the defaults plus
           max logits

Reported: the median per-round ratio updates/agent over all steps (the amortised cost), and the
sampled steps' own extra time measured directly around the probe's optimizer hooks (its
copy of the local weights, the norm passes over weights, update and moments), amortised over
the interval and divided by the median step time: that figure has no round-to-round noise.
Usage: python benchmarks/update_cost.py [--rounds N] [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.overhead import build_model, quartiles, write_section  # noqa: E402


def timed(hook, spent: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            spent[-1] += time.perf_counter() - t0
    return wrapper


def run(args: argparse.Namespace) -> dict:
    import torch

    import ddpmon

    torch.set_num_threads(args.threads)
    replicas, mons = {}, {}
    probe_time: list[float] = [0.0]
    for mode, options in (("agent", {"update_every": 0}),
                          ("updates", {"update_every": args.every, "logit_modules": ["head"]})):
        model = build_model(args.d_model, args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if mode == "updates":  # time the probe's own hooks (registered before the monitor's)
            from ddpmon.probes import updates

            cls = updates.UpdateProbe
            cls._pre, cls._post = timed(cls._pre, probe_time), timed(cls._post, probe_time)
        mons[mode] = ddpmon.attach(model, opt, port=0, bind="127.0.0.1",
                                   run_dir=tempfile.mkdtemp(), run_id=mode, **options)
        replicas[mode] = (model, opt)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
    y = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    opt_time: list[float] = []

    def step(mode: str) -> float:
        model, opt = replicas[mode]
        t0 = time.perf_counter()
        loss = loss_fn(model(x).reshape(-1, 1024), y.reshape(-1))
        mons[mode].observe_loss(loss)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        if mode == "agent":  # AdamW's own step (the agent's hooks around it are tiny)
            opt_time.append(time.perf_counter() - t1)
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for mode in replicas:
        step(mode)
    rng = random.Random(1234)
    rounds, probe, due = [], [], []
    for _ in range(args.rounds):
        order = list(replicas)
        rng.shuffle(order)
        probe_time.append(0.0)
        due.append(mons["updates"].step % args.every == 0)  # the probe samples this step
        rounds.append({mode: step(mode) for mode in order})
        probe.append(probe_time[-1])
    params = sum(p.numel() for p in replicas["agent"][0].parameters())
    for mon in mons.values():
        mon.close()
    return {"rounds": rounds, "probe": probe, "due": due, "params": params,
            "optimizer": statistics.median(opt_time)}


def summarize(data: dict, args: argparse.Namespace) -> str:
    rounds = data["rounds"]
    ratios = [r["updates"] / r["agent"] for r in rounds]
    q1, med, q3 = quartiles(ratios)
    step = statistics.median(r["agent"] for r in rounds)
    sampled = [t for t, due in zip(data["probe"], data["due"], strict=True) if due]
    others = [t for t, due in zip(data["probe"], data["due"], strict=True) if not due]
    per_sample = statistics.median(sampled) if sampled else 0.0
    per_other = statistics.median(others) if others else 0.0
    amortised = statistics.fmean(data["probe"]) / step
    command = " ".join(["python benchmarks/update_cost.py", *sys.argv[1:]])
    return (
        "## Loss-spike parts: update figures, spike detector, max logits (one process, CPU)\n\n"
        f"Command: `{command}`  \n"
        f"Model: overhead.py's transformer, {data['params'] / 1e6:.1f}M parameters, AdamW, batch "
        f"{args.batch} x {args.seq} tokens, {args.threads} thread(s). Two identical replicas in "
        f"one process, {args.rounds} rounds of one step each in a shuffled order. "
        f"Median step (agent without update figures): {step * 1e3:.0f} ms.\n\n"
        "| figure | value |\n|---|---|\n"
        f"| updates / agent step time, per round (median, Q1-Q3) | {med:.4f}x "
        f"({q1:.4f}-{q3:.4f}x) |\n"
        f"| sampled steps | {len(sampled)} of {len(rounds)} (every {args.every}) |\n"
        f"| probe hooks at a sampled step (median) | {per_sample * 1e3:.2f} ms |\n"
        f"| probe hooks at another step (median) | {per_other * 1e3:.3f} ms |\n"
        f"| AdamW's own step (median) / step time | {data['optimizer'] * 1e3:.1f} ms / "
        f"{data['optimizer'] / step * 100:.1f} % |\n"
        f"| probe hooks at a sampled step / AdamW step | {per_sample / data['optimizer']:.2f}x |\n"
        f"| probe hooks amortised over all steps / step time | **{amortised * 100:.3f} %** |\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    section = summarize(run(args), args)
    print(section)
    if args.write is not None:
        write_section(args.write, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
