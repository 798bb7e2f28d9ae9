"""One rank of the straggler tests under each strategy (gloo on 127.0.0.1, 4 ranks), started by
the test with RANK/WORLD_SIZE/MASTER_* set. Runs its cases in order (``--case
ID:STRATEGY:STEPS:RANK``), each with its own model, optimizer, monitor and run id
(``straggler-ID``) in ``OUT/runs``.

Strategies: ``fsdp2`` (one shard group of 4), ``hsdp`` (2 replicas x 2 shards), ``tp`` (4-way
tensor parallel, every rank the same batch), ``deepspeed`` (ZeRO-1, ``DS_ACCELERATOR=cpu``),
``pp`` (2 stages x 2 data-parallel replicas, 1F1B over 4 micro-batches, each stage under DDP)
and ``ddp-comm`` (DDP; RANK's gradient buckets wait 4 ms in its comm hook before their
all-reduce, as a rank with a slow path to the network does).

The slow rank of the compute cases does 15 % more of its own work per step from step 5 on
(:class:`Burner`: measured on itself, spent in its blocks' forward).
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ddpmon  # noqa: E402

WIDTH, BATCH, BLOCKS, MICRO = 256, 800, 2, 4
EXTRA = 0.15
CALIBRATE = 4
COMM_DELAY_S = 0.004


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Linear(WIDTH, WIDTH)
        self.w_out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(torch.relu(self.w_in(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Burner:
    """15 % more of the slow rank's own work per step, measured on itself: steps 1 to
    CALIBRATE are timed on the training thread's CPU clock (the clock ddpmon's split uses on
    CPU; step 0 holds one-off set-up), then each call of a burning block's forward multiplies
    small matrices for 15 % of the median step's CPU time, spread over the step's calls. The
    growth is the same fraction of the rank's work on any CPU and under any load."""

    def __init__(self, active: bool) -> None:
        self.active, self.per_call, self.calls, self.costs = active, 0.0, 0, []
        self.a, self.b = torch.randn(64, 64), torch.randn(64, 64)

    def burn(self, module: nn.Module) -> None:
        if self.active:
            module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, _args) -> None:
        if not self.per_call:
            self.calls += 1
            return
        end = time.thread_time() + self.per_call
        while time.thread_time() < end:
            torch.mm(self.a, self.b)

    def step(self, step: int, run) -> None:
        if not self.active or self.per_call:
            run(step)
            return
        self.calls = 0 if step == 1 else self.calls
        began = time.thread_time()
        run(step)
        if step >= 1:
            self.costs.append(time.thread_time() - began)
        if len(self.costs) == CALIBRATE:
            median = sorted(self.costs)[CALIBRATE // 2]
            self.per_call = EXTRA * median / max(1, self.calls / CALIBRATE)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", required=True, metavar="ID:STRATEGY:STEPS:RANK")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    # Every rank on one CPU, as in straggler_worker: what else the host runs slows every rank
    # alike, in turn.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for spec in args.case:
        case_id, strategy, steps, slow = spec.split(":")
        began = time.perf_counter()
        burner = Burner(rank == int(slow) and strategy != "ddp-comm")
        run = RUNNERS[strategy](burner, rank, int(slow), case_id, args.out)
        for step in range(int(steps)):
            burner.step(step, run)
        run.mon.flush()
        results[case_id] = {"parts": dict(run.mon.state.step_part_seconds_total),
                            "seconds": time.perf_counter() - began}
        Path(args.out, f"{case_id}.rank{rank}.metrics").write_text(
            run.mon.endpoint.exposition.render().decode())
        run.mon.close()
        dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def attach(model, opt, case_id: str, out: str, **kw):
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(out, "runs"),
                        run_id=f"straggler-{case_id}", announce=False, **kw)
    assert mon.enabled, mon.error
    return mon


class Loop:
    """A plain loop (FSDP2, HSDP, TP, DDP): forward, backward, optimizer step."""

    def __init__(self, model, x: torch.Tensor, case_id: str, out: str, **kw) -> None:
        self.model, self.x = model, x
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.mon = attach(model, self.opt, case_id, out, **kw)

    def __call__(self, step: int) -> None:
        loss = self.model(self.x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.mon.observe_loss(loss)


def sharded(burner: Burner, rank: int, slow: int, case_id: str, out: str,
            dims: tuple[int, ...]) -> Loop:
    torch.manual_seed(0)
    model = Net()
    names = ("shard",) if len(dims) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    for block in model.blocks:
        burner.burn(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    return Loop(model, x, case_id, out)


def tensor_parallel(burner: Burner, rank: int, slow: int, case_id: str, out: str) -> Loop:
    torch.manual_seed(0)
    model = Net()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for block in model.blocks:
        parallelize_module(block, mesh, {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()})
        burner.burn(block)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))  # shared
    return Loop(model, x, case_id, out)


def ddp_comm(_burner: Burner, rank: int, slow: int, case_id: str, out: str) -> Loop:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())

    def hook(state, bucket):
        if rank == slow:
            time.sleep(COMM_DELAY_S)  # the slow rank's own path to the network
        return allreduce_hook(state, bucket)

    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    return Loop(model, x, case_id, out, comm_hook=hook)


class DeepSpeedLoop:
    def __init__(self, burner: Burner, rank: int, slow: int, case_id: str, out: str) -> None:
        import deepspeed  # only this case needs DeepSpeed (seconds to import)

        torch.manual_seed(0)
        model = Net()
        for block in model.blocks:
            burner.burn(block)
        config = {
            "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config)
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
        self.mon = ddpmon.attach(self.engine, port=0, run_dir=os.path.join(out, "runs"),
                                 run_id=f"straggler-{case_id}", announce=False)
        assert self.mon.enabled, self.mon.error

    def __call__(self, step: int) -> None:
        loss = self.engine(self.x).pow(2).mean()
        self.engine.backward(loss)
        self.engine.step()
        self.mon.observe_loss(loss)


class PipelineLoop:
    """2 stages x 2 replicas: stage = rank // 2 (``pp`` is the mesh's outer dimension)."""

    def __init__(self, burner: Burner, rank: int, slow: int, case_id: str, out: str) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = mesh["pp"].get_local_rank()
        torch.manual_seed(0)
        block = Net().blocks[stage]
        burner.burn(block)
        # find_unused_parameters: torch's reducer otherwise fails at the second step's bucket
        # rebuild after the schedule's first metadata pass (tests/parallel/_pp_worker.py)
        module = nn.parallel.DistributedDataParallel(
            block, process_group=mesh["dp"].get_group(), find_unused_parameters=True)
        pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(pipe, MICRO, loss_fn=lambda y, t: (y - t).pow(2).mean())
        self.first, self.opt = stage == 0, torch.optim.SGD(module.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
        self.x = torch.randn(BATCH, WIDTH, generator=gen)
        self.mon = attach(module, self.opt, case_id, out, schedule=self.schedule)

    def __call__(self, step: int) -> None:
        if self.first:
            self.schedule.step(self.x)
        else:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=torch.zeros_like(self.x), losses=losses)
            self.mon.observe_loss(torch.stack(losses).mean())
        self.opt.step()
        self.opt.zero_grad()


RUNNERS = {
    "fsdp2": lambda b, r, s, c, o: sharded(b, r, s, c, o, (dist.get_world_size(),)),
    "hsdp": lambda b, r, s, c, o: sharded(b, r, s, c, o, (2, dist.get_world_size() // 2)),
    "tp": tensor_parallel,
    "deepspeed": DeepSpeedLoop,
    "pp": PipelineLoop,
    "ddp-comm": ddp_comm,
}

if __name__ == "__main__":
    raise SystemExit(main())
