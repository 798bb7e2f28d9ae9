"""One rank of the straggler tests (gloo on 127.0.0.1, DDP), started by the test with
RANK/WORLD_SIZE/MASTER_* set. Runs its cases in order (``--case ID:KIND:STEPS:RANK``), each with
its own model, optimizer, monitor and run id (``straggler-ID``) in ``OUT/runs``; writes each
case's step parts (the agent's counters) and its exposition to ``OUT``.

Kinds: ``clean`` (every rank alike), ``compute`` (RANK's batch holds 15 % more rows than the
others': 15 % more forward and backward work per step) and ``data`` (RANK sleeps 20 ms before
each step's forward, as a slow input pipeline does). The model is a 2-layer MLP of few parameters
(a short all-reduce) fed large batches, so that its compute, which grows with the rows, not the
per-parameter work (optimizer, gradient buckets) or Python, makes most of each rank's own time.
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpmon

WIDTH, BATCH, LAYERS = 256, 1000, 2
EXTRA_ROWS = 150  # 15 % of BATCH
DATA_DELAY_S = 0.020


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", required=True, metavar="ID:KIND:STEPS:RANK")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    # Every rank on one CPU: what else the host runs then slows every rank alike, in turn, and
    # no rank is slower for long because the scheduler placed it beside a busy neighbour.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for spec in args.case:
        case_id, kind, steps, slow = spec.split(":")
        results[case_id] = run_case(case_id, kind, int(steps), int(slow), rank, args.out)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_case(case_id: str, kind: str, steps: int, slow: int, rank: int, out: str) -> dict:
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    model = DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(out, "runs"),
                        run_id=f"straggler-{case_id}")
    rows = BATCH + (EXTRA_ROWS if kind == "compute" and rank == slow else 0)
    gen = torch.Generator().manual_seed(rank)
    dataset = [torch.randn(rows, WIDTH, generator=gen) for _ in range(4)]
    dist.barrier()
    for step in range(steps):
        x = dataset[step % len(dataset)]  # the loop's data loading
        if kind == "data" and rank == slow:
            time.sleep(DATA_DELAY_S)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.observe_loss(loss)
    mon.flush()
    parts = dict(mon.state.step_part_seconds_total)
    text = mon.endpoint.exposition.render().decode()
    Path(out, f"{case_id}.rank{rank}.metrics").write_text(text)
    mon.close()
    dist.barrier()
    return {"parts": parts, "run_id": f"straggler-{case_id}"}


if __name__ == "__main__":
    raise SystemExit(main())
