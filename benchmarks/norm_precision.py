"""The CPU gradient-norm pass, old and new side by side: its cost and its precision.

Until issue 35, CPU norms were one float32 reduction per tensor (``torch._foreach_norm``; small
same-shaped tensors stacked, one row each), which drifts low on long tensors. Now each tensor is
reduced in float32 rows of ``CHUNK`` elements whose squares add in float64
(``ddpmon.probes.grads``). Both run here on the same gradients, interleaved in rounds, against
an fp64 reference (and fp64 accumulation's own cost, the obvious alternative):

- the overhead benchmark's transformer (benchmarks/overhead.py: 26.3M parameters);
- BERT-base's parameter shapes (110M; word embeddings 30522 x 768);
- the host-cost MLP (8 x Linear(64), benchmarks/host_cost.py), through the stacked path, which
  stays float32 (float64 there cost 50 us a step in host_cost.py): old and new are one code.

Gradients mix magnitudes (values times exp(2 N(0,1))). Reported: median time per pass (ms) and
the ratio new/old per round (median, quartiles), and the largest relative error of the global
norm and of any one tensor's norm against fp64.

Usage: python benchmarks/norm_precision.py [--rounds N] [--threads N] [--write RESULTS.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ddpmon.probes.grads import CHUNK, ParamIndex, per_param_norms


def bert_shapes() -> list[tuple[int, ...]]:
    d, ff, vocab = 768, 3072, 30522
    shapes: list[tuple[int, ...]] = [(vocab, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(12):
        shapes += [(d, d), (d,)] * 4 + [(ff, d), (ff,), (d, ff), (d,)] + [(d,)] * 4
    return shapes + [(d, d), (d,)]


def transformer_shapes() -> list[tuple[int, ...]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from overhead import build_model

    model = build_model(512, 8)
    return [tuple(p.shape) for p in model.parameters()]


def mixed(shapes: Sequence[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=gen) * torch.exp(2 * torch.randn(s, generator=gen))
        for s in shapes
    ]


def old_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 pass ddpmon ran before: one reduction per tensor."""
    return torch.stack(torch._foreach_norm(list(grads), 2)).double()


def old_stacked(index: ParamIndex, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The stacked pass before: one float32 row per small tensor."""
    plan = index.stack_plan
    parts = [
        torch.linalg.vector_norm(torch.stack([grads[i] for i in g]).reshape(len(g), -1), dim=1)
        for g in plan.stacks
    ]
    if plan.rest:
        parts.append(torch.stack(torch._foreach_norm([grads[i] for i in plan.rest], 2)))
    return torch.cat(parts).double()


def fp64_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float64))


def errors(norms: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    total = math.sqrt(float(norms.square().sum()))
    exact = math.sqrt(float(reference.square().sum()))
    per = ((norms - reference).abs() / reference.clamp_min(1e-300)).max()
    return abs(total - exact) / exact, float(per)


def measure(passes: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in passes}
    for f in passes.values():
        f()  # warm-up
    for r in range(rounds):
        order = list(passes.items())
        if r % 2:
            order.reverse()
        for name, f in order:
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for label, shapes in (
        ("transformer (overhead.py), 26.3M", transformer_shapes()),
        ("BERT-base shapes, 110M", bert_shapes()),
    ):
        grads = mixed(shapes)
        reference = fp64_norms(grads)
        passes = {
            "old": lambda g=grads: old_norms(g),
            "new": lambda g=grads: per_param_norms(g),
            "fp64": lambda g=grads: fp64_norms(g),
        }
        rows.append((label, sum(g.numel() for g in grads), passes, reference, args.rounds))
    mlp = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    for p, g in zip(mlp.parameters(), mixed([tuple(p.shape) for p in mlp.parameters()]),
                    strict=True):
        p.grad = g
    index = ParamIndex(mlp)
    order = list(index.stack_plan.order)
    grads = [p.grad for p in index.params]
    reference = fp64_norms([grads[i] for i in order])
    rows.append((
        "8 x Linear(64) MLP (host_cost.py), stacked", sum(g.numel() for g in grads),
        {
            "old": lambda: old_stacked(index, grads),
            "new": lambda: index.stack_plan.norms(grads),
            "fp64": lambda: fp64_norms(grads),
        },
        reference, args.rounds * 20,
    ))
    lines = [
        "## CPU gradient-norm pass: float32 rows vs one float32 reduction (issue 35)",
        "",
        f"{args.threads} torch thread(s); rows of {CHUNK} elements; gradients mix magnitudes "
        "(values times exp(2 N(0,1))); each pass interleaved with the others in every round. "
        "Errors are relative to an fp64 reference of the same gradients. fp64 accumulation is "
        "shown as the alternative it replaces.",
        "",
        "| gradients | elements | old ms | new ms | fp64 ms | new/old per round: median (Q1-Q3) "
        "| global-norm error old / new | worst tensor error old / new |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, numel, passes, reference, rounds in rows:  # reference: in each pass's order
        times = measure(passes, rounds)
        ratio = quartiles([n / o for n, o in zip(times["new"], times["old"], strict=True)])
        old_err = errors(passes["old"](), reference)
        new_err = errors(passes["new"](), reference)
        lines.append(
            f"| {label} | {numel:,} | {statistics.median(times['old']) * 1e3:.2f} | "
            f"{statistics.median(times['new']) * 1e3:.2f} | "
            f"{statistics.median(times['fp64']) * 1e3:.2f} | "
            f"**{ratio[0]:.2f}x** ({ratio[1]:.2f}-{ratio[2]:.2f}) | "
            f"{old_err[0]:.1e} / **{new_err[0]:.1e}** | {old_err[1]:.1e} / {new_err[1]:.1e} |"
        )
    lines += [
        "",
        f"Machine load (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from overhead import write_section

        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
