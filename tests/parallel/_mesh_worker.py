"""One rank of the mesh-shape checks: ``ddpmon.attach`` on a small layered model under each
2-rank mesh shape in turn (plain DDP, FSDP2, FSDP2 on a one-rank dp mesh beside TP, as
torchtitan builds it, HSDP with a one-rank replicate or shard dim, TP alone), in a plain loop.
Each step records ddpmon's global and group norms, an fp64 reference from the gradients the
optimizer is about to apply (``.full_tensor()``), and what ``clip_grad_norm_`` returns; the last
step puts a NaN into one gradient on rank 1 (``--nan``: into the output gradient of a middle
layer, ``activation``, or into one parameter's gradient, ``param``). Assertions live in
tests/parallel/test_mesh_shapes.py.

Run as: ``python _mesh_worker.py --out DIR --shapes a,b,... --nan activation|param`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (tests/support/ranks.py), 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ddpmon
from tests.parallel._worker import destroy_process_group_now

D, H, LAYERS, BATCH = 64, 256, 4, 8
STEPS = 4  # the last one carries the NaN
NAN_LAYER = "layers.2"  # a middle layer: two nearer the loss, two farther
NAN_PARAM = "layers.2.w_out.weight"  # ``--nan param``: a TP-sharded weight (stays on rank 1)
NAN_RANK = 1
GROUPS = ("embed", "layers", "norm", "output")


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w_in = nn.Linear(D, H)  # 16,384 weights: CPU norms by float32 rows
        self.w_out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(torch.relu(self.w_in(self.norm(x))))


class Net(nn.Module):
    """Registration order is forward order, as in torchtitan's Transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


FEATURE_SCALE = torch.exp(2.0 * torch.randn(D, generator=torch.Generator().manual_seed(7)))
TP_PLAN = {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()}


def build(shape: str, rank: int) -> tuple[nn.Module, int]:
    """The model under ``shape`` and this rank's data seed (TP ranks share a batch)."""
    torch.manual_seed(0)
    model = Net()
    world = dist.get_world_size()
    if shape == "plain":  # no wrapper: each rank trains on its own
        return model, rank
    if shape == "ddp":
        return nn.parallel.DistributedDataParallel(model), rank
    if shape == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        _shard(model, mesh)
        return model, rank
    if shape == "fsdp2-bf16":
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        _shard(model, mesh, mp_policy=policy)
        return model, rank
    if shape == "dp1+tp":  # torchtitan's TP: fully_shard on a one-rank dp mesh beside tp
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], TP_PLAN)
        _shard(model, mesh["dp"])
        return model, 0
    if shape in ("hsdp-r1", "hsdp-s1"):  # one-rank replicate dim, or one-rank shard dim
        dims = (1, world) if shape == "hsdp-r1" else (world, 1)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))
        _shard(model, mesh)
        return model, rank
    if shape == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for layer in model.layers:
            parallelize_module(layer, mesh, TP_PLAN)
        return model, 0
    raise SystemExit(f"unknown shape {shape}")


def _shard(model: Net, mesh, **kw) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """fp64 global and group norms of the full gradients, computed here from the tensors."""
    squares = dict.fromkeys(GROUPS, 0.0)
    for name, param in named:
        if param.grad is not None:
            grad = full(param.grad).detach().double()
            squares[name.split(".")[0]] += float(grad.square().sum())
    return {
        "global": math.sqrt(sum(squares.values())),
        "groups": {g: math.sqrt(v) for g, v in squares.items()},
    }


def torch_clip(params: list[torch.Tensor]) -> float | None:
    """What ``clip_grad_norm_`` returns (max_norm high: nothing is changed); None where torch
    refuses the mix (DTensors of different meshes, DTensor beside plain tensors)."""
    try:
        return float(full(torch.nn.utils.clip_grad_norm_(params, max_norm=1e30)))
    except Exception:
        return None


def poison_output_grad(layer: nn.Module) -> None:
    """On its next forward, a tensor hook on ``layer``'s output puts a NaN into the gradient
    that flows back into it (once)."""

    def forward_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        handle.remove()

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
            return grad

        output.register_hook(poison)

    handle = layer.register_forward_hook(forward_hook)


def poison_param_grad(module: nn.Module) -> None:
    """The next gradient of ``module.weight`` gets a NaN at one element, where autograd makes it
    (FSDP2's unsharded parameter: the hook is registered in a forward pre-hook)."""

    def poison(grad: torch.Tensor) -> torch.Tensor:
        hook.remove()
        if isinstance(grad, DTensor):
            local = grad.to_local().clone()
            local.view(-1)[0] = float("nan")
            return DTensor.from_local(local, grad.device_mesh, grad.placements,
                                      shape=grad.shape, stride=grad.stride())
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def pre_hook(mod: nn.Module, args: tuple) -> None:
        nonlocal hook
        pre.remove()
        hook = mod.weight.register_hook(poison)

    hook = None
    pre = module.register_forward_pre_hook(pre_hook)


def run(shape: str, nan: str, out: Path, rank: int) -> dict:
    model, seed = build(shape, rank)
    inner = getattr(model, "module", model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(out / "runs"), run_id=f"mesh-{shape}",
                        announce=False)
    assert mon.enabled, mon.error
    named = list(inner.named_parameters())
    params = [p for _, p in named]
    gen = torch.Generator().manual_seed(1000 + seed)
    refs, clips = [], []
    for step in range(STEPS):
        x = torch.randn(BATCH, D, generator=gen) * FEATURE_SCALE
        y = torch.randn(BATCH, 8, generator=gen)
        if step == STEPS - 1 and rank == NAN_RANK:
            if nan == "activation":
                poison_output_grad(inner.get_submodule(NAN_LAYER))
            else:
                poison_param_grad(inner.get_submodule(NAN_PARAM.rsplit(".", 1)[0]))
        loss = (model(x).float() - y).square().mean()
        mon.observe_loss(loss)
        loss.backward()
        refs.append(reference(named))
        clips.append(torch_clip(params))
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.flush()
    records = [{
        "step": r.step,
        "global": r.grad_norm,
        "groups": dict(r.group_norms),
        "local_nonfinite": r.local_nonfinite,
        "local_nonfinite_param": r.local_nonfinite_param,
        "origin": r.origin,
        "collective_bytes": dict(r.collective_bytes),
    } for r in mon.recent_steps()]
    result = {"kind": mon.strategy, "refs": refs, "clips": clips, "ours": records,
              "errors": dict(mon.state.agent_errors), "names": [n for n, _ in named],
              "backward_order": mon.index.order.names(mon.index.names),
              "precision": mon.state.precision}
    mon.close()
    manifest = out / "runs" / f"mesh-{shape}" / "manifest.json"
    result["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--nan", choices=("activation", "param"), default="activation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    results = {shape: run(shape, args.nan, out, rank) for shape in args.shapes.split(",")}
    destroy_process_group_now()
    path = out / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "shapes": results}))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
