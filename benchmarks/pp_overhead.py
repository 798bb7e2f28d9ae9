"""Step-time overhead of ddpmon under pipeline parallel: GPipe, 2 stages, one 2-rank gloo job on
CPU, measured side by side.

Modes (each with its own identical split model, ``PipelineStage`` and ``ScheduleGPipe`` in the
same job; a round runs ``--block`` steps of each mode back to back, the modes in a shuffled
order, the same order on both ranks since every ``schedule.step()`` is collective):
  base     unmonitored
  agent    ``ddpmon.attach(part, opt, schedule=schedule)`` (stage probes per micro-batch, one norm
           pass after ``schedule.step()``, the 2-number pp all-reduce, step pipeline, readback,
           endpoint)

Reports the median, quartiles and min-max of per-round ratios (of block sums) agent/base, on
the wall clock and on the training thread's CPU time (``time.thread_time``), and the time
inside ddpmon's pipeline source per step.
Usage: python benchmarks/pp_overhead.py [--rounds N] [--block N] [--d-model D] [--layers L]
       [--batch B]
(rank processes are launched by this script; --worker is internal).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from two_ranks import residual_blocks

MODES = ("base", "agent")
MICROBATCHES = 4
AGENT_TARGET = 1.02
"""agent / base step time, side by side in one run (issue 52)."""



def build_model(d_model: int, layers: int):
    """The residual blocks and a linear head in one ``nn.Sequential``, split into stages."""
    from torch import nn

    return nn.Sequential(*residual_blocks(d_model, layers), nn.Linear(d_model, d_model))

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import ddpmon

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = build_model(args.d_model, args.layers)
    per = (len(whole) + world - 1) // world
    replicas = {}
    for mode in MODES:
        torch.manual_seed(0)
        part = build_model(args.d_model, args.layers)[rank * per : (rank + 1) * per]
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=lambda out, y: F.mse_loss(out, y))
        replicas[mode] = (part, stage, schedule, torch.optim.AdamW(part.parameters(), lr=1e-4))
    parts = ("on_backward_end", "collect")
    inside = dict.fromkeys(parts, 0.0)
    inside["inside_cpu"] = 0.0  # the source's own code in the training thread's CPU time
    with tempfile.TemporaryDirectory() as run_dir:
        part, stage, schedule, opt = replicas["agent"]
        mon = ddpmon.attach(
            part, opt, schedule=schedule, port=args.port, bind="127.0.0.1", run_dir=run_dir,
            run_id="bench-pp", announce=False,
        )
        assert mon.enabled, mon.error
        source = mon.source
        for name in parts:
            original = getattr(source, name)

            def timed(*a, _fn=original, _name=name, **kw):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _fn(*a, **kw)
                finally:
                    inside[_name] += time.perf_counter() - t0
                    inside["inside_cpu"] += time.thread_time() - c0

            setattr(source, name, timed)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, args.d_model, generator=gen)
        y = torch.randn(args.batch, args.d_model, generator=gen)
        first, last = rank == 0, rank == world - 1
        params = sum(p.numel() for p in whole.parameters())

        def step(mode: str, cpu: dict[str, float]) -> float:
            """One step's wall time; its training-thread CPU time is added to ``cpu[mode]``."""
            part, stage, schedule, opt = replicas[mode]
            losses: list = []
            t0, c0 = time.perf_counter(), time.thread_time()
            kwargs = {"target": y, "losses": losses} if last else {}
            schedule.step(*((x,) if first else ()), **kwargs)
            if mode == "agent" and last:
                mon.observe_loss(torch.stack(losses).mean())
            opt.step()
            opt.zero_grad(set_to_none=True)
            cpu[mode] = cpu.get(mode, 0.0) + time.thread_time() - c0
            return time.perf_counter() - t0

        order_rng = random.Random(1234)  # same order on every rank: steps are collective
        for _ in range(2):
            for mode in MODES:
                step(mode, {})  # warm-up (metadata pass, allocations)
        rounds = []
        for _ in range(args.rounds):
            order = list(MODES)
            order_rng.shuffle(order)
            inside.update(dict.fromkeys(inside, 0.0))
            cpu: dict[str, float] = {}
            times = {mode: sum(step(mode, cpu) for _ in range(args.block)) for mode in order}
            times.update(inside)
            times["inside"] = sum(inside[k] for k in parts)
            times.update({f"{mode}_cpu": v for mode, v in cpu.items()})
            rounds.append(times)
        errors = sum(mon.state.agent_errors.values())
        mon.close()
    if rank == 0:
        result = {"rounds": rounds, "params": params, "errors": errors}
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def summarize(data: dict, args: argparse.Namespace) -> str:
    from fsdp_overhead import _ratio_row, _verdict
    from overhead import quartiles

    rounds, block = data["rounds"], args.block
    wall = [r["agent"] / r["base"] for r in rounds]
    cpu = [r["agent_cpu"] / r["base_cpu"] for r in rounds]
    med, cpu_med = statistics.median(wall), statistics.median(cpu)
    b1, bmed, b3 = (v / block for v in quartiles([r["base"] for r in rounds]))
    c1, cmed, c3 = (v / block for v in quartiles([r["base_cpu"] for r in rounds]))
    s1, smed, s3 = quartiles([r["inside"] / r["base"] for r in rounds])
    u1, umed, u3 = quartiles([r["inside_cpu"] / r["base_cpu"] for r in rounds])
    end = statistics.median(r["on_backward_end"] for r in rounds) * 1000 / block
    wait = statistics.median(r["collect"] for r in rounds) * 1000 / block
    cmd = (
        f"python benchmarks/pp_overhead.py --rounds {args.rounds} --block {block} "
        f"--d-model {args.d_model} "
        f"--layers {args.layers} --batch {args.batch} --threads {args.threads}"
    )
    return "\n".join(
        [
            "## Pipeline parallel overhead (GPipe, 2 stages, 2-rank gloo on CPU)",
            "",
            f"Command: `{cmd}`  ",
            f"Model: {args.layers} residual MLP blocks (d={args.d_model}, 4x hidden) and a head, "
            f"{data['params'] / 1e6:.1f}M parameters split over 2 stages, GPipe with "
            f"{MICROBATCHES} micro-batches, AdamW, batch {args.batch}, {args.threads} thread(s) "
            f"per rank, 2 ranks on {os.cpu_count()} cores (shared with other work); "
            f"{args.rounds} rounds of {block} steps of each mode back to back, the modes in a "
            f"shuffled order per round; a round's ratio is of its block sums, on two clocks: "
            f"wall, and rank 0's training-thread CPU time (not accrued while descheduled, so "
            f"other processes move it far less; it leaves out the agent's own threads and any "
            f"wait). Machine load (1 min) at the start and the end: {data['load'][0]} and "
            f"{data['load'][1]}.  ",
            f"Unmonitored step: median {bmed * 1000:.1f} ms wall (quartiles {b1 * 1000:.1f}-"
            f"{b3 * 1000:.1f} ms), {cmed * 1000:.1f} ms training-thread CPU (quartiles "
            f"{c1 * 1000:.1f}-{c3 * 1000:.1f} ms). Probe errors: {data['errors']}.  ",
            f"Time inside the pipeline source per step on rank 0: median {smed * 100:.1f}% of "
            f"the unmonitored step's wall (quartiles {s1 * 100:.1f}-{s3 * 100:.1f}%), "
            f"{umed * 100:.1f}% of its training-thread CPU (quartiles {u1 * 100:.1f}-"
            f"{u3 * 100:.1f}%): end of schedule.step (norm pass, pp all-reduce issued) "
            f"{end:.2f} ms, collect (probes' flags; the pp all-reduce is left to the record "
            f"thread) {wait:.2f} ms (wall medians). The per-micro-batch stage probes run "
            f"inside the schedule and show in the agent ratio only.  ",
            f"Target: agent / base <= {AGENT_TARGET:.2f}x: median {med:.3f}x wall "
            f"({_verdict(med, AGENT_TARGET)}), {cpu_med:.3f}x training-thread CPU "
            f"({_verdict(cpu_med, AGENT_TARGET)}).",
            "",
            "| ratio | median | q1 | q3 | min-max | rounds |",
            "|---|---|---|---|---|---|",
            _ratio_row("agent / base (GPipe, 2 stages), wall", wall, len(rounds)),
            _ratio_row("agent / base (GPipe, 2 stages), training-thread CPU", cpu, len(rounds)),
            "",
        ]
    )


def main() -> None:
    from two_ranks import bench_main

    bench_main(__file__, worker, summarize)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/overhead.py: shared helpers
    main()
