"""One rank of the DTensor-loss check: ``ddpmon.attach`` on a DDP model in a plain loop that hands
over its loss and its norm as DTensors on a 2x2 ("dp", "tp") mesh of 4 ranks, the way a TP or
``full_dtensor`` trainer holds them. One placement per step (``CASES``): a Replicate loss, the
linear ``Partial`` losses ddpmon records as shares, a one-element ``Shard`` loss one rank holds,
and a ``Partial(max)`` loss and a norm's ``_NormPartial`` that ddpmon drops alone and counts.
The full value of each is taken here with ``full_tensor()`` (a collective of the harness's own,
never ddpmon's). Writes what it saw to --out; the assertions live in
tests/parallel/test_observed_values.py.

Run as: ``python _observed_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set (tests/support/ranks.py), 4 ranks.
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.parallel._worker import destroy_process_group_now

CASES = ("replicate", "avg_sum", "replicate_sum", "shard_one", "max", "norm_partial")
"""The loss handed over at each step, in order."""
SHARED = ("avg_sum", "replicate_sum")
"""Steps whose loss each rank records as its share (the full value is the ranks' mean)."""
DROPPED = ("max", "norm_partial")
"""Steps with a value ddpmon drops alone and counts (the loss at ``max``, the norm at the
other)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_local_rank("tp")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(args.out, "runs"))
    gen = torch.Generator().manual_seed(100 + rank)
    full_losses, locals_, norms = [], [], []
    for case in CASES:
        opt.zero_grad()
        local = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        local.backward()
        norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
        loss = _loss(case, local.detach(), mesh, tp)
        full_losses.append(float(loss.full_tensor().reshape(())))
        locals_.append(float(local))
        mon.observe_loss(loss)
        if case == "norm_partial":  # the local piece of a TP trainer's norm of sharded grads
            piece = DTensor.from_local(norm.reshape(1), mesh, [Replicate(), Shard(0)])
            mon.observe_grad_norm(torch.linalg.vector_norm(piece))
        else:
            mon.observe_grad_norm(DTensor.from_local(norm.reshape(1), mesh, [Replicate()] * 2))
        norms.append(float(norm))
        opt.step()
    records = mon.recent_steps()
    result = {
        "rank": rank,
        "tp": tp,
        "full_losses": full_losses,
        "locals": locals_,
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


def _loss(case: str, local: torch.Tensor, mesh, tp: int) -> DTensor:
    """The step's loss as the DTensor a trainer would hold."""
    if case in ("replicate", "norm_partial"):  # the harness's own mean: the full value everywhere
        total = local.clone() / dist.get_world_size()
        dist.all_reduce(total)
        return DTensor.from_local(total, mesh, [Replicate(), Replicate()])
    if case == "avg_sum":  # full_dtensor: averaged over dp, each tp rank a half of its sum
        return DTensor.from_local(local / 2, mesh, [Partial("avg"), Partial("sum")])
    if case == "replicate_sum":  # the same pieces on both dp rows, summed over tp
        return DTensor.from_local(torch.tensor(1.5 + tp), mesh, [Replicate(), Partial("sum")])
    if case == "shard_one":  # one element, held by tp rank 0 of each row
        piece = torch.tensor([2.25]) if tp == 0 else torch.empty(0)
        return DTensor.from_local(piece, mesh, [Replicate(), Shard(0)], shape=torch.Size([1]),
                                  stride=(1,))
    assert case == "max"
    return DTensor.from_local(local, mesh, [Replicate(), Partial("max")])


if __name__ == "__main__":
    main()
