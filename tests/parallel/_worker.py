"""One rank of a sharded-strategy check: drives a gradient source the way the step pipeline does
(``on_backward_end`` after each backward, the user's clip, then ``collect``) and writes raw
numbers next to torch's references. Assertions live in the tests; this only measures.

Run as: ``python _worker.py --strategy fsdp2|hsdp|tp|fsdp2+tp[,...] --out DIR`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Several strategies (same world size) run in turn in one
process: starting the ranks costs more than a strategy's scenarios.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ddpmon.probes.grads import ParamIndex
from ddpmon.strategies.base import NormVector, SourceEnv
from ddpmon.strategies.registry import detect_strategy, make_source

D = 8
NAN_PARAM = "blocks.1.w_in.weight"
NAN_RANK = 1
NAN_STEP = 2
USER_MAX_NORM = 0.05
SAMPLED_EVERY = 4  # the "sampled" scenario's local_norm_every: NAN_STEP is not a sampled step
TOUCH_STEP = 1  # far below the real norms: the user's clip always changes the gradients


class Block(nn.Module):
    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w_in = nn.Linear(D, 2 * D)
        self.w_out = nn.Linear(2 * D, D)
        if spare:  # trainable but unused in forward: it never gets a gradient
            self.spare = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(torch.relu(self.w_in(self.norm(x))))


class Net(nn.Module):
    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block(spare)])
        self.head = nn.Linear(D, 3)  # 3 rows over 2 shards: exercises FSDP2's padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _poison_next_grad(module: nn.Module) -> None:
    """Make the next gradient of ``module.weight`` NaN at one element, on this rank only, at the
    point autograd produces it (before any reduction). The weight seen in forward is FSDP2's
    unsharded parameter, so the hook is registered in a forward pre-hook and fires once."""

    def poison(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        if isinstance(grad, DTensor):
            local = grad.to_local().clone()
            local.view(-1)[0] = float("nan")
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
            )
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def pre_hook(mod: nn.Module, args: tuple) -> None:
        nonlocal handle
        pre.remove()
        handle = mod.weight.register_hook(poison)

    handle = None
    pre = module.register_forward_pre_hook(pre_hook)


def _vector(v: NormVector | None) -> dict | None:
    if v is None:
        return None
    return {"norms": v.norms.tolist(), "positions": list(v.positions), "scaled": v.scaled}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(strategy: str, scenario: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = Net(spare=scenario == "unused")
    rank, world = dist.get_rank(), dist.get_world_size()
    info: dict = {"data_seed": rank}
    if strategy == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        kw: dict = {"mesh": mesh, "reshard_after_forward": scenario != "no_reshard_mp"}
        if scenario == "no_reshard_mp":
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif strategy == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block, mesh, {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()})
        info["data_seed"] = 0  # TP ranks see the same batch
    elif strategy == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(
                block, mesh["tp"], {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()}
            )
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        info["data_seed"] = mesh.get_coordinate()[0]  # same batch within a TP group
    else:
        raise SystemExit(f"unknown strategy {strategy}")
    return model, info


def user_clip(params: list[nn.Parameter], max_norm: float) -> float:
    """What a training loop does: clip in place, and the pre-clip norm it logs (torch's value;
    computed per parameter where torch refuses a mix of meshes or of DTensor/plain)."""
    try:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        return float(_full(total))
    except Exception:
        sq = sum(float(_full(p.grad).double().norm()) ** 2 for p in params if p.grad is not None)
        total = math.sqrt(sq)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (total + 1e-6))
        return total


def make_partial(param: nn.Parameter) -> None:
    """Turn a replicated gradient into an equivalent Partial one (unequal split over ranks)."""
    grad = param.grad
    frac = 0.25 if grad.device_mesh.get_local_rank() == 0 else 0.75
    local = grad.to_local() * frac
    param.grad = DTensor.from_local(local, grad.device_mesh, [Partial()], run_check=False)


def run_scenario(strategy: str, scenario: str, steps: int, micro: int) -> dict:
    model, info = build(strategy, scenario)
    kind = detect_strategy(model)
    index = ParamIndex(model)
    errors: list[str] = []
    env = SourceEnv(
        model=model,
        index=index,
        on_error=lambda p, e: errors.append(f"{p}: {e!r}"),
        # every step, so each step's local numbers are checked; "sampled" runs the CPU default
        # way (one norm pass every SAMPLED_EVERY steps, a sum check on the others)
        local_norm_every=SAMPLED_EVERY if scenario == "sampled" else 1,
        # the duplicate-data check on every step where the scenario is about it
        data_check_interval=1 if scenario in ("dupdata", "nested") else 10,
    )
    source = make_source(kind, env)
    source.install()
    params = list(index.params)
    opt = torch.optim.SGD(params, lr=0.05)
    spare = scenario == "unused"
    ref_model = Net(spare) if strategy in ("fsdp2", "hsdp") else None
    # "dupdata": every rank seeded alike, as a script that forgot to shard its data would be
    gen = torch.Generator().manual_seed(1000 + (0 if scenario == "dupdata" else info["data_seed"]))
    records = []
    fsdp = strategy != "tp"
    for step in range(steps):
        batches = [torch.randn(4, D, generator=gen) for _ in range(micro)]
        if ref_model is not None:  # this rank's unreduced gradients, for the local reference
            ref_model.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
            ref_model.zero_grad()
            for x in batches:
                ref_model(x).square().mean().backward()
            local_ref = math.sqrt(
                sum(float(p.grad.norm()) ** 2 for p in ref_model.parameters() if p.grad is not None)
            )
        else:
            local_ref = None
        if scenario in ("nan", "sampled") and step == NAN_STEP and dist.get_rank() == NAN_RANK:
            _poison_next_grad(model.get_submodule(NAN_PARAM.rsplit(".", 1)[0]))
        opt.zero_grad(set_to_none=True)
        for m, x in enumerate(batches):
            if fsdp:
                model.set_requires_gradient_sync(m == micro - 1)
            model(x).square().mean().backward()
            if scenario == "partial":
                make_partial(model.get_submodule("blocks.0.w_out").bias)
            source.on_backward_end()
        ref_params = [
            float(_full(p.grad).double().norm()) if p.grad is not None else 0.0 for p in params
        ]
        if step == TOUCH_STEP:  # an in-place op on the gradients: no reuse, a fresh pass
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0)
        clip_norm = float(_full(source.clip_norm(params)))
        ref_total = user_clip(params, USER_MAX_NORM)
        clip_after = float(_full(source.clip_norm(params)))  # reuse is once per step
        out = source.collect()
        records.append(
            {
                "step": step,
                "reduced": _vector(out.reduced),
                "local": _vector(out.local),
                "local_complete": out.local_complete,
                "local_ref": local_ref,
                "ref_total": ref_total,
                "ref_params": ref_params,
                "clip_norm": clip_norm,
                "clip_after": clip_after,
                "identical_ranks": None if out.identical_ranks is None
                else int(out.identical_ranks),
                "post_clip_norm": math.sqrt(
                    sum(
                        float(_full(p.grad).double().norm()) ** 2
                        for p in params
                        if p.grad is not None
                    )
                ),
            }
        )
        opt.step()
    source.close()
    return {
        "kind": kind,
        "source": source.name,
        "names": index.names,
        "group_names": index.group_names,
        "group_of": index.group_of,
        "errors": errors,
        "records": records,
        "clip_reused": source.clip_norms_reused,
    }


def fsdp1_kind() -> str:
    """What attach would decide for an FSDP1-wrapped model (real FSDP1 on CPU/gloo)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"))
    return detect_strategy(wrapped)


def destroy_process_group_now() -> None:
    """``destroy_process_group`` that really ends gloo's threads here, not in interpreter exit.

    destroy only drops torch's own references; the group, its gloo worker and transport threads
    and rank 0's TCPStore server live on while anything else holds it. DTensor's caches do
    (DTensorSpec / redistribute planner -> DeviceMesh -> ProcessGroup; the C++ fast-path
    sharding cache invisibly to ``gc``), so after any DTensor work those threads ran on into
    interpreter finalization and ``exit()``, where a rank rarely died of a signal after its
    results were written. Clearing the caches and collecting the models' cycles first lets
    destroy join them; ``comm_threads`` checks it.
    """
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    dist.barrier()
    debug._clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()
    dist.destroy_process_group()


def comm_threads() -> list[str] | None:
    """Names of this process's gloo / TCPStore threads (None where /proc is not there)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while listed
            continue
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


SCENARIOS = {
    "fsdp2": [
        ("nested", 12, 1),
        ("no_reshard_mp", 12, 1),
        ("accum", 6, 2),
        ("nan", 3, 1),
        ("unused", 3, 1),
        ("sampled", 5, 1),
        ("dupdata", 2, 1),
    ],
    "hsdp": [("nested", 12, 1), ("accum", 4, 2), ("nan", 3, 1), ("sampled", 5, 1),
             ("dupdata", 2, 1)],
    "tp": [("nested", 12, 1), ("accum", 4, 2), ("nan", 3, 1), ("partial", 3, 1)],
    "fsdp2+tp": [("nested", 12, 1), ("accum", 4, 2), ("nan", 3, 1), ("sampled", 5, 1),
                 ("dupdata", 2, 1)],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank, "strategies": {}}
    for strategy in args.strategy.split(","):
        done: dict = {"scenarios": {}}
        for name, steps, micro in SCENARIOS[strategy]:
            done["scenarios"][name] = run_scenario(strategy, name, steps, micro)
        if strategy == "fsdp2":
            done["fsdp1_kind"] = fsdp1_kind()
        result["strategies"][strategy] = done
    destroy_process_group_now()
    result["comm_threads_after_destroy"] = comm_threads()
    path = Path(args.out) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
