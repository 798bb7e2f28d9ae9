"""One rank of the FLOP-counting test: for DDP, FSDP2 and TP (2 gloo ranks) and each model of
tests/support/flop_models.py, ``mon.count_flops`` on one step of the wrapped model against the
FLOPs this rank must do: ``FlopCounterMode``'s own count of the same step on a plain copy of the
model, with each tensor-parallel Linear's matmuls (forward and backward, from its shapes) and
attention split by heads at this rank's share. Then a small language model on token ids under
TP and as 2 pipeline stages: each rank's tokens/s, steps/s and the automatic FLOP count, and
``FlopCounterMode``'s own count of this stage's step."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

import ddpmon
from ddpmon.flops.count import cpu_attention
from tests.support.flop_models import DIM, SEQ, TP_PLANS, batch, build
from tests.support.ports import free_ports

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
HEADS_SPLIT = {"gqa_swa"}
"""Models whose TP plan splits the attention heads (the dense layer's attention is replicated)."""


def step_of(model, opt, x):
    def run():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return run


def expected(kind: str, strategy: str, x, world: int) -> float:
    plain = build(kind)
    sharded = _sharded_linear_flops(plain, TP_PLANS[kind]) if strategy == "tp" else []
    total = {}
    for attention in (True, False):
        mode = FlopCounterMode(display=False, custom_mapping=cpu_attention() if attention else {})
        with mode:
            step_of(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x)()
        total[attention] = mode.get_total_flops()
        if attention:
            sharded = list(sharded)  # the hooks fire again on the second run: keep the first
    if strategy == "tp" and kind in HEADS_SPLIT:  # each rank attends with its share of heads
        sharded.append(total[True] - total[False])
    return total[True] - sum(sharded) + sum(sharded) / world


def _sharded_linear_flops(model, plan: dict[str, str]) -> list[float]:
    """Filled in by the step: each tensor-parallel Linear's matmul FLOPs (forward 2*N*in*out;
    backward the weight gradient, and the input gradient when its input needs one)."""
    found: list[float] = []
    for name in plan:
        def hook(mod, inputs, _out, found=found):
            (inp,) = inputs
            n = inp.numel() // inp.shape[-1]
            found.append(2 * n * mod.in_features * mod.out_features
                         * (2 + bool(inp.requires_grad)))
        model.get_submodule(name).register_forward_hook(hook)
    return found


def wrap(kind: str, strategy: str, mesh):
    model = build(kind)
    if strategy == "ddp":
        return DistributedDataParallel(model)
    if strategy == "fsdp2":
        return fully_shard(model, mesh=mesh)
    plan = {name: STYLES[style]() for name, style in TP_PLANS[kind].items()}
    return parallelize_module(model, mesh, plan)


def attach(model, opt, out: str, run_id: str, **options):
    # an endpoint: the automatic count runs where the figures are served
    port = free_ports(1) - int(os.environ["LOCAL_RANK"])
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(Path(out) / "runs"),
                        run_id=run_id, linger_seconds=0, flops_count_step=2, **options)
    assert mon.enabled, mon.error
    return mon


VOCAB = 64


def lm_figures(mon, step, ids) -> dict:
    """Tokens/s and steps/s of this rank after the automatic count (3rd step, closed by the
    4th's forward): the rates' baseline read once, then 3 more steps."""
    for _ in range(4):
        step()
    automatic = mon.flops_per_step
    mode = FlopCounterMode(display=False, custom_mapping=cpu_attention())
    with mode:  # FlopCounterMode's own count of this rank's step (TP: the whole model's)
        step()
    mon.flush()
    mon.throughput.rates()  # the baseline: a step read back after the count
    for _ in range(3):
        step()
    mon.flush()
    rates = mon.throughput.rates()
    return {"auto": automatic, "expected": mode.get_total_flops(),
            "tokens_per_second": rates["tokens_per_second"],
            "steps_per_second": rates["steps_per_second"], "true_tokens": ids.numel()}


def lm_cases(rank: int, world: int, mesh, out: str) -> dict:
    """A language model on token ids under TP (every rank reads the batch) and as pipeline
    stages (the first reads the ids, the second their activations)."""
    ids = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(VOCAB, DIM), build("dense"), nn.Linear(DIM, VOCAB))
    tp = parallelize_module(lm, mesh, {"1.linear1": ColwiseParallel(),
                                       "1.linear2": RowwiseParallel()})
    opt = torch.optim.SGD(tp.parameters(), lr=0.01)
    mon = attach(tp, opt, out, "tp-lm")
    results = {"tp:lm": lm_figures(mon, step_of(lambda x: tp(x).logsumexp(-1), opt, ids), ids)}
    mon.close()
    dist.barrier()
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Embedding(VOCAB, DIM), build("dense")),
              nn.Sequential(build("dense"), nn.Linear(DIM, VOCAB))]
    module = stages[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, 2, loss_fn=lambda logits, _: logits.logsumexp(-1).mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    mon = attach(module, opt, out, "pp-lm", schedule=schedule)

    def pp_step():
        schedule.step(ids) if rank == 0 else schedule.step(target=ids)
        opt.step()
        opt.zero_grad()

    results["pp:lm"] = lm_figures(mon, pp_step, ids)
    results["pp:lm"]["shared_by"] = mon.throughput.tokens_shared_by
    mon.close()
    dist.barrier()
    # FSDP2 + TP on a (1, world) mesh: the TP dim shares the batch, the dp dim does not
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(build("dense"), mesh2d["tp"], {"linear1": ColwiseParallel(),
                                                             "linear2": RowwiseParallel()})
    model = fully_shard(model, mesh=mesh2d["dp"])
    mon = attach(model, torch.optim.SGD(model.parameters(), lr=0.01), out, "fsdp2-tp")
    results["fsdp2+tp:shared_by"] = [mon.strategy, mon.throughput.tokens_shared_by]
    mon.close()
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = lm_cases(rank, world, mesh, args.out)
    dist.barrier()
    for strategy in ("ddp", "fsdp2", "tp"):
        for kind in ("dense", "gqa_swa", "moe"):
            # TP ranks see the same batch (they shard the model, not the data)
            x = batch(0 if strategy == "tp" else rank)
            model = wrap(kind, strategy, mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            mon = attach(model, opt, args.out, f"{strategy}-{kind}")
            for _ in range(4):  # counted on the 3rd step, closed by the 4th's forward
                step_of(model, opt, x)()
            automatic = mon.flops_per_step
            mon.count_flops(step_of(model, opt, x))
            results[f"{strategy}:{kind}"] = {"counted": mon.flops_per_step, "auto": automatic,
                                             "shared_by": mon.throughput.tokens_shared_by,
                                             "expected": expected(kind, strategy, x, world),
                                             "unsharded": expected(kind, "ddp", x, world)}
            mon.close()
            dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
