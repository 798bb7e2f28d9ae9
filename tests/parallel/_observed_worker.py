"""One rank of the DTensor-loss check: ``ddpmon.attach`` on a DDP model in a plain loop that hands
over its loss and its norm as DTensors over a 2-rank mesh, the way a TP trainer holds them.
Replicate on every step but one; on ``PARTIAL_STEP`` the loss is a ``Partial`` DTensor (each
rank holds its share of the sum), whose full value would need a collective: ddpmon drops it
alone and counts it. Writes what it saw to --out; the assertions live in
tests/parallel/test_observed_values.py.

Run as: ``python _observed_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set (tests/support/ranks.py), 2 ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.parallel._worker import destroy_process_group_now

STEPS = 4
PARTIAL_STEP = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(args.out, "runs"))
    gen = torch.Generator().manual_seed(100 + rank)
    full_losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        local = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        local.backward()
        total = local.detach().clone() / world  # the harness's own sum: the full mean loss
        dist.all_reduce(total)
        norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
        if step == PARTIAL_STEP:
            mon.observe_loss(DTensor.from_local(local.detach() / world, mesh, [Partial()]))
        else:
            mon.observe_loss(DTensor.from_local(total, mesh, [Replicate()]))
        mon.observe_grad_norm(DTensor.from_local(norm.reshape(1), mesh, [Replicate()]))
        full_losses.append(float(total))
        norms.append(float(norm))
        opt.step()
    records = mon.recent_steps()
    result = {
        "rank": rank,
        "full_losses": full_losses,
        "norms": norms,
        "errors": {k: v for k, v in mon.state.agent_errors.items() if v},
        "steps": [
            {
                "step": r.step,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "trainer_grad_norm": r.trainer_grad_norm,
                "grad_norm_mismatch": r.grad_norm_mismatch,
            }
            for r in records
        ],
    }
    mon.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    del model, opt, mesh
    destroy_process_group_now()


if __name__ == "__main__":
    main()
