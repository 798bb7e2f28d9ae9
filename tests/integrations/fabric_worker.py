"""A 2-rank Lightning Fabric training script on CPU, written as public Fabric scripts are.

Run as ``python fabric_worker.py --out DIR --port P ...``: ``fabric.launch()`` re-runs this
script for rank 1 (Lightning's subprocess launcher). ``fabric.setup`` / ``setup_dataloaders``,
``fabric.backward``, gradient accumulation under ``fabric.no_backward_sync`` and
``fabric.clip_gradients(model, optimizer, max_norm=1.0)``; ddpmon is attached with what
``fabric.setup`` returned. The script records the pre-clip norm ``clip_gradients`` returned at
each step, and ddpmon's numbers after it. At ``--nan-step`` rank ``--nan-rank`` gets a NaN in
its input; with ``--error-if-nonfinite`` ``clip_gradients`` then raises (Fabric's default).
``--same-data``: every rank reads the same batches (no distributed sampler: a duplicated shard).
``--attach-before-setup``: ddpmon attached to the bare module before ``fabric.setup`` (a mistake).
``A --then B``: run A, then run B in the same launch (each its own out dir and port).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

import ddpmon
from tests.support.integrations import agent_options, json_number


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--error-if-nonfinite", action="store_true")
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--attach-before-setup", action="store_true")
    return p


def main(argv: list[str]) -> None:
    """One Fabric, one launch; each ``--then``-separated argument group is a run of its own
    (own model, loader, ddpmon monitor, port and out dir), one after another, all on the first
    group's strategy: one process start per rank, as a script that trains several models."""
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            groups.append([])
        else:
            groups[-1].append(arg)
    runs = [_parser().parse_args(group) for group in groups]
    if len({a.strategy for a in runs}) != 1:
        raise SystemExit("every run of one launch needs the same strategy")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy(runs[0].strategy))
    fabric.launch()
    for a in runs:
        train(fabric, a)


def train(fabric: Fabric, a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fabric.seed_everything(0)

    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    early = None
    if a.attach_before_setup:  # the mistake: ddpmon then sees the bare module, and says so
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        early = ddpmon.attach(model, optimizer, **agent_options(a.port, out))
        model, optimizer = fabric.setup(model, optimizer)
    elif a.strategy == "fsdp2":  # sharded: the model first, the optimizer over its new parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = fabric.setup(model, optimizer)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16) * 3, torch.randn(4096, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=not a.same_data)

    mon = early or ddpmon.attach(model, optimizer, **agent_options(a.port, out))
    clip_norms: dict[int, float] = {}
    ours: dict[str, dict[int, float | None]] = {"grad_norm": {}, "local_norm": {}}
    result = {"rank": fabric.global_rank, "attached": mon.enabled, "error": None,
              "monitor_error": mon.error, "clip_norms": clip_norms, **ours}
    batches = iter(loader)
    try:
        for step in range(a.steps):
            for micro in range(a.accumulate):
                x, y = next(batches)
                if (step, micro, fabric.global_rank) == (a.nan_step, 0, a.nan_rank):
                    x = x.clone()
                    x[0, 0] = float("nan")
                accumulating = micro < a.accumulate - 1
                with fabric.no_backward_sync(model, enabled=accumulating):
                    loss = nn.functional.mse_loss(model(x), y) / a.accumulate
                    fabric.backward(loss)
            norm = fabric.clip_gradients(model, optimizer, max_norm=1.0,
                                         error_if_nonfinite=a.error_if_nonfinite)
            clip_norms[step] = json_number(norm)
            optimizer.step()
            optimizer.zero_grad()
            _sample(mon, ours)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if result["error"] is None:
            mon.close()  # drains the last steps; an exception leaves that to ddpmon's handlers
        _sample(mon, ours)
        result["monitor_steps"] = mon.step
        result["strategy"] = getattr(mon, "strategy", None)
        result["exposition"] = mon.exposition.render().decode() if mon.enabled else ""
        (out / f"result.rank{fabric.global_rank}.json").write_text(json.dumps(result))


def _strategy(name: str):
    """``ddp`` as Fabric names it, or ``fsdp2``: ``ModelParallelStrategy`` with FSDP2's
    ``fully_shard`` on each layer and the root, as Lightning's FSDP2 examples do (Lightning's
    ``FSDPStrategy`` is FSDP1 and runs on GPU only)."""
    if name != "fsdp2":
        return name
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: nn.Module, mesh) -> nn.Module:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    return ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)


def _sample(mon, ours: dict) -> None:
    """ddpmon's numbers of the last step whose values have arrived (read back lazily)."""
    if not mon.enabled:
        return
    state = mon.state
    if state.step >= 0:
        ours["grad_norm"][state.step] = json_number(state.grad_norm)
        ours["local_norm"][state.step] = json_number(state.grad_local_norm)


if __name__ == "__main__":
    main(sys.argv[1:])
