"""Step-time overhead of ``ddpmon.attach(engine)`` on DeepSpeed ZeRO-2 and ZeRO-3, measured side by
side in one 2-rank gloo job on CPU (``DS_ACCELERATOR=cpu``).

Per stage two identical engines run in the same job: ``base`` (unmonitored) and ``agent``
(``ddpmon.attach(engine)``), interleaved step by step in a shuffled order per round, so drift
and noise hit both alike. The agent's own time is broken down by where it runs:

  hooks       ddpmon's tensor hooks (one norm of each micro-batch's local gradient)
  engine.step at the entry of ``engine.step``: the scale noted, the reduced partitions' norms
              and their one small SUM all-reduce, issued async (``allreduce``: the call)
  step close  after ``engine.step``: the all-reduce waited (done by then: DeepSpeed's own step
              collectives came after it), the step record queued for readback (and drained)
  forward     the forward pre-hook (step timing, batch shapes once)

Reports medians and quartiles of per-round ratios agent/base, and of the time inside each part.
Usage: python benchmarks/deepspeed_overhead.py [--rounds N] [--d-model D] [--layers L]
[--batch B] [--write benchmarks/RESULTS.md] (rank processes are launched by this script).
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

from two_ranks import residual_net as build_model

STAGES = (2, 3)
MODES = ("base", "agent")
PARTS = ("hooks", "engine_step", "allreduce", "step_close", "forward")


def ds_config(stage: int, batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    import ddpmon
    try:  # the source's home since issue 47; before it (before_after.py), strategies/deepspeed.py
        from ddpmon.strategies.deepspeed import source as ds_source
    except ImportError:
        import ddpmon.strategies.deepspeed as ds_source

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    inside = dict.fromkeys(PARTS, 0.0)  # seconds in ddpmon's own code, this step

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[name] += time.perf_counter() - t0

        return wrapper

    def with_timed_allreduce(fn):
        """``fn`` with ``torch.distributed.all_reduce`` timed while it runs (training thread)."""

        def wrapper(*a, **kw):
            real = dist.all_reduce
            dist.all_reduce = timed("allreduce", real)
            try:
                return fn(*a, **kw)
            finally:
                dist.all_reduce = real

        return wrapper

    real_local_hook = ds_source.DeepSpeedSource._local_hook
    ds_source.DeepSpeedSource._local_hook = lambda self, pos: timed(
        "hooks", real_local_hook(self, pos)
    )
    results: dict = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for stage in STAGES:
            engines = {}
            for mode in MODES:
                model = build_model(args.d_model, args.layers)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                engines[mode], *_ = deepspeed.initialize(
                    model=model, optimizer=opt, config=ds_config(stage, args.batch)
                )
            mon = ddpmon.attach(
                engines["agent"], port=args.port, bind="127.0.0.1", run_dir=run_dir,
                run_id=f"bench-z{stage}",
            )
            src, steps = mon.source, engine_steps(mon)
            src.note_scale = timed("engine_step", src.note_scale)
            src.measure_reduced = timed("engine_step", with_timed_allreduce(src.measure_reduced))
            steps._on_step = timed("step_close", steps._on_step)
            flow = getattr(mon, "flow", None) or mon.pipeline  # mon.pipeline before its rename
            flow.forward_started = timed("forward", flow.forward_started)
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(args.batch, args.d_model, generator=gen)

            schedule = random.Random(1234 + stage)  # same on every rank: collectives match
            for _ in range(3):
                for mode in MODES:
                    _step(engines[mode], x)  # warm-up (allocations, lazy init)
            rounds = []
            for _ in range(args.rounds):
                order = list(MODES)
                schedule.shuffle(order)
                inside.update(dict.fromkeys(PARTS, 0.0))
                times = {mode: _step(engines[mode], x) for mode in order}
                times.update(inside)
                times["inside"] = sum(v for k, v in inside.items() if k != "allreduce")
                rounds.append(times)
            errors = {k: v for k, v in mon.state.agent_errors.items() if v}
            mon.close()
            for engine in engines.values():
                engine.destroy()
            results[f"zero{stage}"] = {"rounds": rounds, "errors": errors}
    if rank == 0:
        params = sum(p.numel() for p in build_model(args.d_model, args.layers).parameters())
        Path(args.out).write_text(json.dumps({"stages": results, "params": params}))
    dist.barrier()
    dist.destroy_process_group()


def engine_steps(mon):
    """The agent's wrapper of ``engine.step``: since issue 47 one of the markers the strategy
    installs (``StepMarkers.own``), before it ``StepMarkers.engine_steps``."""
    own = getattr(mon.markers, "own", None)
    if own is None:
        return mon.markers.engine_steps
    return next(marker for marker in own if hasattr(marker, "_on_step"))


def _step(engine, x) -> float:
    t0 = time.perf_counter()
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def summarize(data: dict, args: argparse.Namespace) -> str:
    from overhead import quartiles

    def ms(values: list[float]) -> str:
        q1, med, q3 = quartiles(values)
        return f"{med * 1000:.2f} ({q1 * 1000:.2f}-{q3 * 1000:.2f})"

    rows, parts = [], []
    for name, stage in data["stages"].items():
        rounds = stage["rounds"]
        q1, med, q3 = quartiles([r["agent"] / r["base"] for r in rounds])
        rows.append(
            f"| {name} | {med:.3f}x | {q1:.3f}x | {q3:.3f}x | {ms([r['base'] for r in rounds])} "
            f"| {ms([r['agent'] for r in rounds])} | {len(rounds)} | {len(stage['errors'])} |"
        )
        share = statistics.median(r["inside"] / r["base"] for r in rounds)
        parts.append(
            f"| {name} | {ms([r['hooks'] for r in rounds])} | "
            f"{ms([r['engine_step'] for r in rounds])} | {ms([r['allreduce'] for r in rounds])} | "
            f"{ms([r['step_close'] for r in rounds])} "
            f"| {ms([r['forward'] for r in rounds])} | {ms([r['inside'] for r in rounds])} | "
            f"{share * 100:.1f}% |"
        )
    cmd = (
        f"python benchmarks/deepspeed_overhead.py --rounds {args.rounds} --d-model "
        f"{args.d_model} --layers {args.layers} --batch {args.batch} --threads {args.threads}"
    )
    return "\n".join(
        [
            "## DeepSpeed ZeRO overhead (2-rank gloo on CPU)",
            "",
            f"Command: `{cmd}`  ",
            f"Model: {args.layers} residual MLP blocks (d={args.d_model}, 4x hidden), "
            f"{data['params'] / 1e6:.1f}M parameters, torch AdamW inside DeepSpeed's ZeRO "
            f"optimizer, gradient clipping 1.0, fp32, batch {args.batch}, accumulation 1, "
            f"{args.threads} thread(s) per rank, 2 ranks on {os.cpu_count()} cores "
            f"(`DS_ACCELERATOR=cpu`); per stage {args.rounds} rounds, one step of the "
            f"unmonitored and of the monitored engine per round in a shuffled order. The box "
            f"is shared (1-minute load average {data['load'][0]} at the start, "
            f"{data['load'][1]} at the end): the step ratios are noisy, the time inside ddpmon's "
            f"own code (second table) is the direct figure. Target: <= 1.03x.",
            "",
            "| stage | agent/base median | q1 | q3 | base step ms (q1-q3) | agent step ms "
            "(q1-q3) | rounds | probe errors |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Time inside ddpmon per step, ms, median (quartiles): tensor hooks (local norm of "
            "each gradient), at `engine.step` (reduced norms + one async all-reduce; of which "
            "issuing the all-reduce), step close (the all-reduce waited, the record queued), "
            "forward pre-hook; total and its median share of the base step.",
            "",
            "| stage | hooks | engine.step | of which all-reduce call | step close | forward "
            "| total | share of base |",
            "|---|---|---|---|---|---|---|---|",
            *parts,
            "",
        ]
    )


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/overhead.py: shared helpers
    from two_ranks import bench_main

    bench_main(
        __file__, worker, summarize, timeout=900,
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
             # the venv's own op builds (as the Makefile and the tests set it), not ~/.cache's
             "TORCH_EXTENSIONS_DIR": os.environ.get(
                 "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))},
    )


if __name__ == "__main__":
    main()
