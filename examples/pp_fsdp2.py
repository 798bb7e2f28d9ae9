"""Pipeline parallel x FSDP2 under ddpmon, on CPU: 2 stages x 2 data-parallel replicas, 4 ranks.

    torchrun --nproc-per-node 4 examples/pp_fsdp2.py [--steps N] [--nan-step K]
                                                     [--run-dir DIR] [--port P] [--summary FILE]

Ranks 0-1 hold stage 0 (embedding + 2 residual blocks), ranks 2-3 stage 1 (2 blocks, norm, head,
loss); each stage is sharded with FSDP2 over its 2 replicas, and torch's Schedule1F1B runs 4
micro-batches per step. The ddpmon part is three calls: ``ddpmon.attach(stage_module, optimizer,
schedule=schedule)``, ``mon.observe_loss(...)`` on the last stage, ``mon.close()``.

What it shows, rank 0 printing:

- every step, ddpmon's global gradient norm (one number, the same on every rank, over both
  stages) beside a reference: torchtitan's ``clip_grad_norm_(..., pp_mesh=)`` when torchtitan is
  installed, else the same sum computed with plain torch;
- at step ``--nan-step`` (default: the last), a NaN injected into an activation gradient inside
  stage 1 on rank 2 only; ddpmon names it as the origin (stage, rank, micro-batch, site), and
  not the other 3 ranks, which only received the NaN;
- the loss exported by the last stage only, and each rank's send/recv (pipeline) and
  reduce_scatter/all_gather (FSDP2) times, from its step records and from its own /metrics.

``--summary FILE`` writes the same as JSON (tests/parallel/test_pp_example.py reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import urllib.request

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import ddpmon

VOCAB, DIM, SEQ, BATCH, MICROBATCHES = 32, 32, 8, 8, 4
OPS = ("send", "recv", "reduce_scatter", "all_gather")


# -- the model, split by hand into two stages ------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stage(nn.Module):
    """One pipeline stage: stage 0 embeds tokens, stage 1 ends in the vocabulary logits."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(index)  # the same weights on both replicas of a stage
        self.embed = nn.Embedding(VOCAB, DIM) if index == 0 else None
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM) if index == 1 else None
        self.head = nn.Linear(DIM, VOCAB) if index == 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.blocks:
            h = block(h)
        if self.head is None:
            return h
        # (batch * seq, vocab): a Linear on 3-D input returns a view, which FSDP2 warns about
        return self.head(self.norm(h).flatten(0, 1))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's half of the step's global batch (next-token targets)."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (2 * BATCH, SEQ + 1), generator=gen)
    mine = tokens[dp_rank * BATCH : (dp_rank + 1) * BATCH]
    return mine[:, :-1], mine[:, 1:]


# -- the reference norm -----------------------------------------------------------------------


def reference_norm(params: list[nn.Parameter], pp_mesh) -> tuple[float, str]:
    """The global L2 norm of every gradient of both stages, by another route than ddpmon's.

    A collective: every rank calls it. torchtitan's ``clip_grad_norm_`` takes each stage's norm
    over its FSDP2 shards and sums the squares over the pp group (max_norm=inf: no clipping).
    Without torchtitan: each rank's squared local shards, summed over all 4 ranks (the shards
    of a stage are disjoint and the two stages hold different parameters)."""
    try:
        from torchtitan.distributed.utils import clip_grad_norm_
    except ImportError:
        local = sum(p.grad.to_local().double().pow(2).sum() for p in params)
        dist.all_reduce(local)
        return float(local.sqrt()), "torch (local shard squares, all-reduced over the world)"
    return float(clip_grad_norm_(params, math.inf, pp_mesh=pp_mesh)), "torchtitan clip_grad_norm_"


# -- the injected NaN -------------------------------------------------------------------------


def inject_nan(stage_module: nn.Module, armed: dict) -> None:
    """Poison the gradient flowing back into stage 1's first block output for one micro-batch:
    an activation gradient produced inside this stage (its forward hook counts micro-batches;
    the loop resets the count each step and arms it at --nan-step)."""

    def forward_hook(module, inputs, output):
        armed["calls"] += 1
        if armed["on"] and armed["calls"] == armed["microbatch"] + 1:
            output.register_hook(lambda grad: grad * float("nan"))

    stage_module.blocks[0].register_forward_hook(forward_hook)


# -- the run ----------------------------------------------------------------------------------


def scrape(port: int) -> dict:
    """This rank's own /metrics: the ``ddpmon_loss`` line (absent off the last stage) and the
    per-op count and total seconds of ``ddpmon_collective_duration_seconds``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    loss = [ln for ln in text.splitlines() if ln.startswith("ddpmon_loss{")]
    ops: dict[str, dict] = {}
    for m in re.finditer(
        r'^ddpmon_collective_duration_seconds_(count|sum)\{[^}]*op="(\w+)"[^}]*\} (\S+)$',
        text,
        re.M,
    ):
        ops.setdefault(m[2], {})["count" if m[1] == "count" else "seconds"] = float(m[3])
    return {"loss_line": loss[0] if loss else None, "collectives": ops}


def train(args) -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_mesh, dp_mesh = mesh["pp"], mesh["dp"]
    stage_index, dp_rank = pp_mesh.get_local_rank(), dp_mesh.get_local_rank()

    part = Stage(stage_index)
    for block in part.blocks:  # FSDP2 on the dp sub-mesh, never over pp
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)  # no re-gather per micro-batch
    stage = PipelineStage(part, stage_index, 2, torch.device("cpu"), group=pp_mesh.get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
    params = list(part.parameters())

    mon = ddpmon.attach(
        part, optimizer, schedule=schedule,
        port=args.port, bind="127.0.0.1", run_dir=args.run_dir, run_id=args.run_id,
    )
    if not mon.enabled:
        raise SystemExit(f"ddpmon is off: {mon.error}")

    armed = {"on": False, "calls": 0, "microbatch": args.nan_microbatch}
    injected_here = stage.is_last and dp_rank == 0 and args.nan_step >= 0
    if injected_here:
        inject_nan(part, armed)

    steps, how = [], ""
    for step in range(args.steps):
        armed["calls"], armed["on"] = 0, step == args.nan_step
        x, y = batch(step, dp_rank)
        if stage.is_first:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            mon.observe_loss(torch.stack(losses).mean())  # the mean: scale_grads=True
        reference, how = reference_norm(params, pp_mesh)
        optimizer.step()  # ddpmon collects the step here
        optimizer.zero_grad()

        record = mon.recent_steps()[-1]  # waits for the step's record: fine for a demo
        steps.append({
            "step": record.step, "ddpmon_norm": record.grad_norm, "reference_norm": reference,
            "loss": record.loss, "collective_seconds": record.collective_seconds,
            "origin": record.origin, "pp_origin": record.pp_origin,
        })
        if rank == 0:
            ours = "none" if record.grad_norm is None else f"{record.grad_norm:.6f}"  # failed
            note = f"   <- NaN injected (rank 2, micro-batch {args.nan_microbatch})"
            print(f"step {record.step:3d}  ddpmon global norm {ours}   reference {reference:.6f}"
                  f"{note if step == args.nan_step else ''}", flush=True)

    collectives: dict[str, dict] = {}
    for s in steps:
        for op, seconds in s["collective_seconds"].items():
            entry = collectives.setdefault(op, {"count": 0, "seconds": 0.0})
            entry["count"] += len(seconds)
            entry["seconds"] += sum(seconds)
    summary = {
        "rank": rank, "stage": stage_index, "dp_rank": dp_rank, "injected_here": injected_here,
        "steps": steps, "collectives": collectives, "reference": how,
        "origins": [{"step": s["step"], **s["pp_origin"]} for s in steps if s["pp_origin"]],
        "metrics": scrape(mon.port) if mon.port else None,
        "run_path": str(mon.run_path), "port": mon.port,
    }
    mon.close()
    return summary


# -- the report -------------------------------------------------------------------------------


def report(ranks: list[dict], args) -> dict:
    print(f"\nreference norm: {ranks[0]['reference']}")
    head = f"{'rank':>4} {'stage':>5} {'loss exported':>18} " + " ".join(f"{op:>16}" for op in OPS)
    print(f"\nper rank, {args.steps} steps (loss: first -> last finite; "
          f"collectives: count, total seconds)\n{head}")
    for r in ranks:
        losses = [s["loss"] for s in r["steps"] if s["loss"] is not None]
        finite = [v for v in losses if math.isfinite(v)]
        loss = f"yes {finite[0]:.3f}->{finite[-1]:.3f}" if finite else "yes" if losses else "no"
        cells = [r["collectives"].get(op, {"count": 0, "seconds": 0.0}) for op in OPS]
        print(f"{r['rank']:>4} {r['stage']:>5} {loss:>18} "
              + " ".join(f"{c['count']:>6} {c['seconds']:8.4f}s" for c in cells))
    scraped = [(r, r["metrics"]) for r in ranks if r["metrics"] is not None]
    if scraped:
        print("\neach rank's own /metrics, scraped before close:")
    for r, m in scraped:
        ops = ", ".join(f"{op} {int(v['count'])}" for op, v in sorted(m["collectives"].items()))
        loss = f'{float(m["loss_line"].split()[-1]):.4f}' if m["loss_line"] else "absent"
        print(f"  rank {r['rank']}: ddpmon_loss {loss:<8} "
              f"ddpmon_collective_duration_seconds_count by op: {ops}")
    origins = [(r["rank"], o) for r in ranks for o in r["origins"]]
    for rank, o in origins:
        print(f"\nNaN origin: step {o['step']}, stage {o['stage']}, rank {rank}, "
              f"micro-batch {o['microbatch']}, site {o['site']} (first parameter: {o['param']})")
    if args.nan_step >= 0 and not origins:
        print("\nNaN origin: none found")
    run_path = ranks[0]["run_path"]
    print(f"\nNext:\n  ddpmon timeline {run_path}\n      every rank's events on one clock")
    if args.port:
        print(f"  while a run is live (--steps 1000), rank r serves "
              f"http://127.0.0.1:{args.port}+r/metrics, e.g. the last stage's:\n"
              f"  curl -s http://127.0.0.1:{args.port + 2}/metrics | "
              "grep -E '^ddpmon_(loss|collective_duration_seconds_count)'")
    return {"reference": ranks[0]["reference"], "run_path": run_path, "ranks": ranks,
            "nan": {"step": args.nan_step, "microbatch": args.nan_microbatch,
                    "rank": next((r["rank"] for r in ranks if r["injected_here"]), None)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nan-step", type=int, default=None, help="default: the last; -1: none")
    parser.add_argument("--nan-microbatch", type=int, default=1, choices=range(MICROBATCHES))
    parser.add_argument("--run-dir", default="ddpmon-runs")
    parser.add_argument("--run-id", default=None, help="default: one chosen by ddpmon")
    parser.add_argument("--port", type=int, default=7470, help="rank r serves port + r; 0: none")
    parser.add_argument("--summary", default=None, help="also write the summary as JSON here")
    args = parser.parse_args()
    if args.nan_step is None:
        args.nan_step = args.steps - 1
    if args.nan_step == 0:  # step 0 also runs the schedule's shape pass through the stage
        parser.error("--nan-step must be >= 1 (or -1 for none)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4 (2 stages x 2 replicas)")
    summary = train(args)
    gathered: list = [None] * 4
    dist.all_gather_object(gathered, summary)
    if dist.get_rank() == 0:
        result = report(gathered, args)
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
