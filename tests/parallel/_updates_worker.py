"""One rank of the sharded update-figure check: a tiny transformer trained with AdamW under DDP,
FSDP2 and tensor parallel in turn on 2 ranks, or HSDP and FSDP2+TP on a 2 x 2 mesh of 4
(``--mesh``), one attach each, with ``update_every=2``. A reference
registered after ddpmon's hooks computes every step's per-group figures from the full tensors
(``.full_tensor()``) before and after the step (tests/support/updates.py). Writes both to
--out; the assertions live in tests/parallel/test_update_figures.py.

Run as: ``python _updates_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set (tests/support/ranks.py), 2 ranks (4 with ``--mesh``).
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.parallel._worker import destroy_process_group_now
from tests.support.updates import Reference, TinyTransformer, batch, loss_of

STEPS = 6
EVERY = 2
STRATEGIES = ("ddp", "fsdp2", "tp")
MESH_STRATEGIES = ("hsdp", "fsdp2+tp")
"""Run with ``--mesh`` on 4 ranks (a 2 x 2 mesh)."""


def tp_plan() -> dict:
    return {"block.linear1": ColwiseParallel(), "block.linear2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate())}


def build(strategy: str, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(what the loop calls, the module whose parameters the reference reads)."""
    torch.manual_seed(0)
    net = TinyTransformer()
    if strategy == "ddp":
        return DDP(net), net
    if strategy in ("fsdp2", "hsdp"):  # hsdp: the 2 x 2 (replicate, shard) mesh
        fully_shard(net.block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, net
    if strategy == "fsdp2+tp":
        parallelize_module(net, mesh["tp"], tp_plan())
        fully_shard(net.block, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
        return net, net
    parallelize_module(net, mesh, tp_plan())
    return net, net


def run(strategy: str, out: str, mesh, rank: int) -> dict:
    model, inner = build(strategy, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(out, strategy),
                        update_every=EVERY)
    reference = Reference(inner, opt)
    # TP peers see the same batch (the sharded dims are the model's, not the data's)
    data_rank = {"tp": 0, "fsdp2+tp": rank // 2}.get(strategy, rank)
    gen = torch.Generator().manual_seed(7 + data_rank)
    for _ in range(STEPS):
        tokens, targets = batch(gen)
        loss = loss_of(model, tokens, targets)
        mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    measured = {r.step: r.update_stats for r in mon.recent_steps() if r.update_stats}
    result = {"strategy": mon.strategy, "measured": measured, "reference": reference.steps,
              "errors": {k: v for k, v in mon.state.agent_errors.items() if v}}
    mon.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mesh", action="store_true", help="HSDP and FSDP2+TP on a 2 x 2 mesh")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mesh:
        meshes = {"hsdp": init_device_mesh("cpu", (2, world // 2),
                                           mesh_dim_names=("replicate", "shard")),
                  "fsdp2+tp": init_device_mesh("cpu", (2, world // 2),
                                               mesh_dim_names=("dp", "tp"))}
        results = {s: run(s, args.out, meshes[s], rank) for s in MESH_STRATEGIES}
    else:
        mesh = init_device_mesh("cpu", (world,))
        results = {s: run(s, args.out, mesh, rank) for s in STRATEGIES}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **results}))
    destroy_process_group_now()


if __name__ == "__main__":
    main()
