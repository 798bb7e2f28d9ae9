"""Cost of the replica checksums (``replica_check_every``) on DDP, measured side by side in one
2-rank gloo job on CPU.

Each round times one unmonitored DDP step of the residual MLP, then one replica check as the
agent runs it at a check step: on the training thread, the checksums (every parameter's raw
bits summed per group) and the all-gather issued (``ReplicaCheck.launch``); on the record
thread, the wait and the comparison (``InFlight.compare``). The amortised cost is the training
thread's share divided by the default interval (a check every 100 steps), against the step.

Usage: python benchmarks/replica_check.py [--rounds N] [--d-model D] [--layers L] [--batch B]
(rank processes are launched by this script; --worker is internal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from two_ranks import residual_net as build_model

EVERY = 100
"""``Config.replica_check_every``'s default."""
TARGET = 0.002
"""Amortised training-thread cost at the default interval, as a share of the step (issue 33)."""


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ddpmon.config import Config
    from ddpmon.probes.grads import ParamIndex
    from ddpmon.strategies.replicas import ReplicaCheck, ReplicaScope

    assert Config().replica_check_every == EVERY
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.d_model, args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    index = ParamIndex(model)
    params = index.params
    scope = ReplicaScope(lambda: params, index.all_positions, None, "bench")
    check = ReplicaCheck.of(scope, index, 1)
    x = torch.randn(args.batch, args.d_model)
    rounds = []
    for r in range(args.rounds + 3):  # 3 warm-up rounds
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        inflight = check.launch(r)
        launch = time.perf_counter() - start
        start = time.perf_counter()
        diverged = inflight.compare()
        compare = time.perf_counter() - start
        assert diverged is None
        if r >= 3:
            rounds.append({"step": step, "launch": launch, "compare": compare})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({
            "rounds": rounds, "params": sum(p.numel() for p in params),
            "tensors": len(params), "groups": index.n_groups,
        }))
    dist.destroy_process_group()


def summarize(data: dict, args: argparse.Namespace) -> str:
    rounds = data["rounds"]
    step = statistics.median(r["step"] for r in rounds)
    launch = statistics.median(r["launch"] for r in rounds)
    compare = statistics.median(r["compare"] for r in rounds)
    share = launch / (EVERY * step)
    cmd = (f"python benchmarks/replica_check.py --rounds {args.rounds} --d-model {args.d_model} "
           f"--layers {args.layers} --batch {args.batch} --threads {args.threads}")
    return "\n".join([
        "## Replica checksums (2-rank gloo DDP on CPU)",
        "",
        f"Command: `{cmd}`  ",
        f"Model: {args.layers} residual MLP blocks (d={args.d_model}, 4x hidden), "
        f"{data['params'] / 1e6:.1f}M parameters in {data['tensors']} tensors and "
        f"{data['groups']} groups, AdamW, batch {args.batch}, {args.threads} thread(s) per "
        f"rank, 2 ranks on {os.cpu_count()} cores; {len(rounds)} rounds, one unmonitored step "
        f"then one check each. Load average {data['load'][0]} before, {data['load'][1]} after.  ",
        f"Unmonitored step: median {step * 1000:.1f} ms. One check: checksums and the gather "
        f"issued on the training thread {launch * 1000:.2f} ms; the wait and the comparison on "
        f"the record thread {compare * 1000:.2f} ms (medians).  ",
        f"Amortised at the default interval (every {EVERY} steps): {share:.3%} of the step on "
        f"the training thread (target <= {TARGET:.1%}: "
        f"{'met' if share <= TARGET else 'NOT met'}).",
        "",
    ])


def main() -> None:
    from two_ranks import bench_main

    bench_main(__file__, worker, summarize)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/overhead.py: shared helpers
    main()
