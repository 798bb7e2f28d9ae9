"""One rank of the norm-precision checks: a ~9.5M-parameter model in few large tensors, fed
inputs whose feature scales span e^+-6 (so gradient magnitudes mix, as in a real model), under
each strategy in turn with ``ddpmon.attach``. Each step records ddpmon's global and group norms
next to an fp64 reference built from the very gradients the optimizer is about to apply, and the
float32 whole-tensor norm of the same gradients (what a float32 running sum gives: the drift the
check must be able to see). Assertions live in tests/parallel/test_norm_precision.py.

Run as: ``python _precision_worker.py --out DIR --strategies ddp,fsdp2,...`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (tests/support/ranks.py), 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import ddpmon  # noqa: E402

D, H, OUT, BATCH, STEPS = 1024, 4096, 8, 16, 2
GROUPS = ("inp", "block", "head")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Linear(D, H)
        self.w_out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(torch.relu(self.w_in(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = Block()
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


FEATURE_SCALE = torch.exp(2.0 * torch.randn(D, generator=torch.Generator().manual_seed(7)))


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + seed)
    return torch.randn(BATCH, D, generator=gen) * FEATURE_SCALE, torch.randn(
        BATCH, OUT, generator=gen
    )


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.float() - target).square().mean()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(named: Iterable[tuple[str, torch.Tensor | None]], group=None) -> dict:
    """fp64 global and group norms, and the float32 whole-tensor global norm, of ``named``
    gradients (summed over ``group`` for pipeline stages, each holding part of the model)."""
    squares = {g: 0.0 for g in GROUPS}
    f32 = 0.0
    for name, grad in named:
        if grad is None:
            continue
        grad = full(grad).detach()
        squares[name.split(".")[0]] += float(grad.double().square().sum())
        f32 += float(torch.linalg.vector_norm(grad.float())) ** 2
    if group is not None:
        vec = torch.tensor([*squares.values(), f32], dtype=torch.float64)
        dist.all_reduce(vec, group=group)
        *values, f32 = vec.tolist()
        squares = dict(zip(GROUPS, values, strict=True))
    return {
        "global": math.sqrt(sum(squares.values())),
        "groups": {g: math.sqrt(v) for g, v in squares.items()},
        "float32": math.sqrt(f32),
    }


def ours(record) -> dict:
    return {
        "step": record.step,
        "global": record.grad_norm,
        "groups": {g: v for g, v in record.group_norms.items()},
    }


def run_loop(strategy: str, out: Path, rank: int) -> dict:
    """DDP, FSDP2 (fp32 and bf16 params), TP: a hand-written loop, the reference taken between
    backward and ``optimizer.step()``."""
    torch.manual_seed(0)
    model, seed = build(strategy, rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    mon = ddpmon.attach(
        model, opt, port=0, run_dir=str(out / "runs"), run_id=f"prec-{strategy}",
        announce=False,
    )
    assert mon.enabled, mon.error
    refs = []
    named = list(_user_names(model))
    for step in range(STEPS):
        x, y = batch(step, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=strategy == "ddp-bf16"):
            loss = loss_of(model(x), y)
        loss.backward()
        refs.append(reference((n, p.grad) for n, p in named))
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.flush()
    result = {"refs": refs, "ours": [ours(r) for r in mon.recent_steps()], "kind": mon.strategy}
    mon.close()
    return result


def _user_names(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    inner = getattr(model, "module", model)
    return inner.named_parameters()


def build(strategy: str, rank: int) -> tuple[nn.Module, int]:
    from torch.distributed.device_mesh import init_device_mesh

    model = Net()
    world = dist.get_world_size()
    if strategy in ("ddp", "ddp-bf16"):
        return nn.parallel.DistributedDataParallel(model), rank
    if strategy in ("fsdp2", "fsdp2-bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict = {"mesh": init_device_mesh("cpu", (world,))}
        if strategy == "fsdp2-bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        fully_shard(model.block, **kw)
        fully_shard(model, **kw)
        return model, rank
    if strategy == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(
            model.block, mesh, {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()}
        )
        return model, 0  # TP ranks see one batch
    raise SystemExit(f"unknown strategy {strategy}")


def run_pp(out: Path, rank: int) -> dict:
    """Two GPipe stages, one per rank: stage 0 ``inp`` + ``block``, stage 1 ``head``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    whole = Net()
    part = nn.ModuleDict({"inp": whole.inp, "block": whole.block} if rank == 0 else {
        "head": whole.head
    })

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, module in part.items():
                self.add_module(name, module)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for module in self.children():
                x = module(x)
            return x

    stage_module = Stage()
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 2, loss_fn=loss_of)
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-6)
    mon = ddpmon.attach(
        stage_module, opt, schedule=schedule, port=0, run_dir=str(out / "runs"),
        run_id="prec-pp", announce=False,
    )
    assert mon.enabled, mon.error
    refs, got = [], []
    for step in range(STEPS):
        x, y = batch(step, 0)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        named = ((n, p.grad) for n, p in stage_module.named_parameters())
        refs.append(reference(named, group=dist.group.WORLD))
        opt.step()
        opt.zero_grad(set_to_none=True)
        got.append(ours(mon.recent_steps()[-1]))
    mon.close()
    return {"refs": refs, "ours": got, "kind": mon.strategy}


def run_zero(stage: int, precision: str, out: Path, rank: int) -> dict:
    """DeepSpeed ZeRO ``stage``: the reference from ``safe_get_full_grad`` at the boundary."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    conf: dict = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        conf["bf16"] = {"enabled": True}
    model = Net()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=conf
    )
    mon = ddpmon.attach(
        engine, port=0, run_dir=str(out / "runs"), run_id=f"prec-z{stage}-{precision}",
        announce=False,
    )
    assert mon.enabled, mon.error
    named = list(engine.module.named_parameters())
    refs = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        if precision == "bf16":
            x = x.bfloat16()
        engine.backward(loss_of(engine(x), y))
        refs.append(reference((n, safe_get_full_grad(p)) for n, p in named))
        engine.step()
    mon.flush()
    result = {"refs": refs, "ours": [ours(r) for r in mon.recent_steps()], "kind": mon.strategy}
    mon.close()
    return result


RUNNERS: dict[str, Callable[[Path, int], dict]] = {
    "ddp": lambda out, rank: run_loop("ddp", out, rank),
    "ddp-bf16": lambda out, rank: run_loop("ddp-bf16", out, rank),
    "fsdp2": lambda out, rank: run_loop("fsdp2", out, rank),
    "fsdp2-bf16": lambda out, rank: run_loop("fsdp2-bf16", out, rank),
    "tp": lambda out, rank: run_loop("tp", out, rank),
    "pp": run_pp,
    **{
        f"z{s}-{p}": (lambda out, rank, s=s, p=p: run_zero(s, p, out, rank))
        for s in (1, 2, 3)
        for p in ("fp32", "bf16")
    },
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    results = {name: RUNNERS[name](out, rank) for name in args.strategies.split(",")}
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "strategies": results}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
