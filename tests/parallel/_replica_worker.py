"""One rank of the replica-checksum checks: real gloo ranks, DDP or DeepSpeed ZeRO-2, faults
injected the way they happen.

``--scenario phases`` (DDP, 4 ranks, a check every ``EVERY`` steps): clean steps, then one fault
at a time, each followed by a check and then a repair (rank 0's parameters broadcast, as a
restart from a good checkpoint would do):
- ``FLIP_STEP``: one bit of one weight flips on ``FLIP_RANK`` (``view(int32) ^= 1 << k``);
- ``SKIP_STEP``: ``SKIP_RANK``'s loop guard skips ``optimizer.step()`` on that rank only;
- ``NOISY_STEP``: a non-deterministic optimizer kernel: each rank's update differs in its
  last bits.
``--scenario resume`` (DDP): ``RESUME_RANK`` loads another checkpoint after the wrap; the check
at the first step of the process compares at once.
``--scenario zero2``: DeepSpeed ZeRO-2 (``DS_ACCELERATOR=cpu``), clean: no mismatch.
``--scenario zero2-flip``: ZeRO-2 on 3 ranks; one bit of a module weight flips on rank 1 after
``FLIP_STEP`` and on ``FLIP_RANK`` after ``ZERO2_FLIP_STEP``, the step before a check. The next
step's forward uses each; that step's all-gather then rewrites the weight from its owner.
``--scenario hsdp``: HSDP on a 2 x 2 mesh (replicate x shard); ``SKIP_RANK``'s loop guard skips
``optimizer.step()`` at ``HSDP_SKIP_STEP`` (FSDP2's step is local: no collective hangs), and one
bit of ``FLIP_RANK``'s local shard flips at ``FLIP_STEP``. Each replicate group has two ranks:
both are named.
``--scenario tp``: tensor parallel over 4 ranks (``head`` row-wise: its bias is replicated);
one bit of ``FLIP_RANK``'s copy of that bias flips at ``FLIP_STEP``.
``--scenario fsdp2-tp``: FSDP2+TP on a 2 x 2 (dp, tp) mesh; one bit of ``FLIP_RANK``'s shard
of the replicated bias flips at ``FLIP_STEP``. Its TP group has two ranks: both are named.
``--scenario clean``: accumulation over two micro-batches (``no_sync``) and bf16 autocast, a
check every step: no mismatch.

Writes ``OUT/rank<R>.json``: the mismatch counter, the ``replica_mismatch`` events, the agent's
probe errors and the manifest's ``replica_check``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddpmon

EVERY = 4
FLIP_STEP, FLIP_RANK, FLIP_BIT = 5, 2, 3  # a mantissa bit: the weight changes by ~1e-6 relative
SKIP_STEP, SKIP_RANK = 13, 1
NOISY_STEP = 21
STEPS = 28
RESUME_RANK = 2
ZERO2_FLIP_STEP = 7  # the step before a check step (8)
HSDP_SKIP_STEP = 1
RUN_ID = "test-replicas"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x)))


def flip_bit(weight: torch.Tensor, element: int, bit: int) -> None:
    with torch.no_grad():
        weight.view(torch.int32).view(-1)[element] ^= 1 << bit


def repair(model: nn.Module) -> None:
    """Every rank takes rank 0's parameters (a restart from a good checkpoint)."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenario", required=True, choices=(
        "phases", "resume", "zero2", "zero2-flip", "clean", "hsdp", "tp", "fsdp2-tp"))
    args = ap.parse_args()
    out = Path(args.out)
    if args.scenario.startswith("zero2"):
        import deepspeed

        deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    every = 1 if args.scenario == "clean" else EVERY
    options = dict(port=0, run_dir=str(out / "runs"), run_id=f"{RUN_ID}-{args.scenario}",
                   replica_check_every=every)
    gen = torch.Generator().manual_seed(100 + rank)
    if args.scenario.startswith("zero2"):
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {
            "type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=config)
        mon = ddpmon.attach(engine, **options)
        for step in range(12):
            loss = engine(torch.randn(4, 8, generator=gen)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if args.scenario == "zero2-flip" and (step, rank) in (
                    (FLIP_STEP, 1), (ZERO2_FLIP_STEP, FLIP_RANK)):
                flip_bit(engine.module.embed.weight, 7, FLIP_BIT)
    elif args.scenario == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(net, mesh, {"embed": ColwiseParallel(), "head": RowwiseParallel()})
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        mon = ddpmon.attach(net, opt, **options)
        data = torch.Generator().manual_seed(100)  # TP: every rank computes on the same batch
        for step in range(10):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            opt.step()
            if step == FLIP_STEP and rank == FLIP_RANK:
                flip_bit(net.head.bias.to_local(), 1, FLIP_BIT)
    elif args.scenario == "fsdp2-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"embed": ColwiseParallel(),
                                             "head": RowwiseParallel()})
        fully_shard(net, mesh=mesh["dp"])
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        mon = ddpmon.attach(net, opt, **options)
        data = torch.Generator().manual_seed(100 + mesh.get_coordinate()[0])  # per TP group
        for step in range(10):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            opt.step()
            if step == FLIP_STEP and rank == FLIP_RANK:
                flip_bit(net.head.bias.to_local(), 0, FLIP_BIT)
    elif args.scenario == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))
        fully_shard(net.embed, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        mon = ddpmon.attach(net, opt, **options)
        for step in range(10):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            if not (step == HSDP_SKIP_STEP and rank == SKIP_RANK):
                opt.step()
            if step == FLIP_STEP and rank == FLIP_RANK:
                flip_bit(net.embed.weight._local_tensor, 1, FLIP_BIT)
    else:
        model = nn.parallel.DistributedDataParallel(net)
        if args.scenario == "resume" and rank == RESUME_RANK:
            with torch.no_grad():  # another checkpoint's weights, loaded after the wrap
                model.module.head.bias.add_(1e-3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = ddpmon.attach(model, opt, **options)
        steps = STEPS if args.scenario == "phases" else 6
        for step in range(steps):
            opt.zero_grad()
            if args.scenario == "clean":
                for micro in range(2):
                    sync = contextlib.nullcontext() if micro else model.no_sync()
                    with sync, torch.autocast("cpu", dtype=torch.bfloat16):
                        model(torch.randn(4, 8, generator=gen)).float().pow(2).mean().backward()
            else:
                model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            if not (args.scenario == "phases" and step == SKIP_STEP and rank == SKIP_RANK):
                opt.step()  # the guard: SKIP_RANK decided on a value only it saw
            if args.scenario != "phases":
                continue
            if step == FLIP_STEP and rank == FLIP_RANK:
                flip_bit(model.module.embed.weight, 7, FLIP_BIT)
            if step == NOISY_STEP:  # the kernel's rounding differs per rank
                with torch.no_grad():
                    noise = torch.Generator().manual_seed(1000 + rank)
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=noise) * 1e-7)
            if step in (FLIP_STEP + EVERY, SKIP_STEP + EVERY):
                mon.flush()  # the check before the repair has been compared
                repair(model)
    mon.flush()
    state = mon.state
    events = [json.loads(line) for line in (
        out / "runs" / f"{RUN_ID}-{args.scenario}" / f"events.rank{rank}.jsonl"
    ).read_text().splitlines()]
    exposed = mon.exposition.render().decode() if mon.exposition is not None else ""
    result = {
        "rank": rank,
        "mismatch_total": state.replica_mismatch_total,
        "events": [e for e in events if e["kind"] == "replica_mismatch"],
        "errors": {k: v for k, v in state.agent_errors.items() if v},
        "exposed": [line for line in exposed.splitlines()
                    if line.startswith("ddpmon_replica_mismatch_total")],
        "steps": state.steps_total,
        "weights": [getattr(p, "_local_tensor", p).detach().reshape(-1).tolist()
                    for p in net.parameters()],
    }
    mon.close()
    manifest = out / "runs" / f"{RUN_ID}-{args.scenario}" / "manifest.json"
    if rank == 0:
        result["replica_check"] = json.loads(manifest.read_text()).get("replica_check")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
