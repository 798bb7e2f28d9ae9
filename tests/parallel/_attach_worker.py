"""One rank of the attach-level FSDP2 check: ``ddpmon.attach`` on a ``fully_shard``-ed model in a
plain training loop (clip, accumulation, a NaN on one rank), scraped over real HTTP after every
step. Writes what it saw to --out; the assertions live in the test.

Run as: ``python _attach_worker.py --out DIR [--port BASE]`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (rank r serves BASE + r).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ddpmon
from tests.parallel._worker import (
    NAN_PARAM,
    D,
    Net,
    _full,
    _poison_next_grad,
    build,
    destroy_process_group_now,
)
from tests.support.ports import free_ports
from tests.support.scrape import scrape_text as scrape

CLEAN_STEPS = 4  # torch's clip on 0-1, ddpmon.clip_grad_norm_ on 2-3
ACCUM_STEPS = 2  # two micro-steps each, sync on the last
NAN_AT = CLEAN_STEPS + ACCUM_STEPS
AFTER = 2  # steps after the NaN was applied: every rank's gradients are NaN (poisoned)
MAX_NORM = 0.05
SCALER_STEPS = 4


def samples(text: str, name: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line.rsplit(" ", 1)
            out.append((labels, float(value)))
    return out


def value(text: str, name: str) -> float | None:
    found = samples(text, name)
    return found[0][1] if found else None


def pre_clip_norm(params: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(_full(p.grad).double().norm()) ** 2 for p in params))


def scaled_steps(model, opt, scaler, mon, params, gen) -> list[dict]:
    """GradScaler loop: scale, unscale_, ddpmon.clip_grad_norm_, step, update."""
    steps = []
    for step in range(SCALER_STEPS):
        loss = model(torch.randn(4, D, generator=gen)).square().mean()
        mon.observe_loss(loss)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        reference = pre_clip_norm(params)
        returned = float(_full(ddpmon.clip_grad_norm_(params, MAX_NORM)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        text = scrape(mon.port)
        steps.append(
            {
                "step": step,
                "reference": reference,
                "clip_returned": returned,
                "grad_norm": value(text, "ddpmon_grad_norm"),
                "grad_local_norm": value(text, "ddpmon_grad_local_norm"),
                "clip_reused": mon.source.clip_norms_reused,
            }
        )
    return steps


def plain_steps(model, opt, mon, params, gen) -> list[dict]:
    """A plain loop without clipping (TP and the other strategies)."""
    steps = []
    for step in range(SCALER_STEPS):
        loss = model(torch.randn(4, D, generator=gen)).square().mean()
        mon.observe_loss(loss)
        loss.backward()
        reference = pre_clip_norm(params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        text = scrape(mon.port)
        steps.append(
            {
                "step": step,
                "reference": reference,
                "grad_norm": value(text, "ddpmon_grad_norm"),
                "grad_local_norm": value(text, "ddpmon_grad_local_norm"),
            }
        )
    return steps


class _Counted:
    """The user's own FSDP2 comm (or all-reduce hook): counts calls, delegates to torch's."""

    def __init__(self, inner, counts: dict, key: str) -> None:
        self.inner, self.counts, self.key = inner, counts, key

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        self.counts[self.key] += 1
        return self.inner(*args, **kwargs) if self.inner is not None else None


def count_collectives(model) -> dict:
    """Install counting comms on every FSDP2 unit before attach (ddpmon wraps them): an
    independent count of what FSDP2 issues, per op."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class RS(_Counted, ReduceScatter):
        pass

    class AG(_Counted, AllGather):
        pass

    counts = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0, "units": 0}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            counts["units"] += 1
            module.set_custom_reduce_scatter(RS(DefaultReduceScatter(), counts, "reduce_scatter"))
            module.set_custom_all_gather(AG(DefaultAllGather(), counts, "all_gather"))
            state = module._get_fsdp_state()
            if any(g._is_hsdp for g in state._fsdp_param_groups):
                module.set_all_reduce_hook(_Counted(None, counts, "all_reduce"))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--port", type=int, default=None, help="base port (default: found free just before attach)"
    )
    parser.add_argument("--scaler", action="store_true", help="GradScaler run (clean steps)")
    parser.add_argument("--strategy", default="fsdp2", help="fsdp2 (full loop) or another kind")
    parser.add_argument(
        "--collectives", action="store_true", help="plain loop, FSDP2 comms counted by the user"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if args.strategy != "fsdp2" or args.collectives:
        model, info = build(args.strategy, "nested")
    else:
        torch.manual_seed(0)
        model = Net()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        info = {"data_seed": rank}
    counts = count_collectives(model) if args.collectives else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if args.scaler else None
    # Picking the port here, not in the test, keeps the window in which another process of a
    # busy suite can take it to milliseconds; a port lost anyway exits with EADDRINUSE, which
    # launch() retries.
    port = args.port if args.port is not None else free_ports(2) - int(os.environ["LOCAL_RANK"])
    mon = ddpmon.attach(
        model,
        opt,
        scaler,
        port=port,
        bind="127.0.0.1",
        run_dir=os.path.join(args.out, "runs"),
        run_id="test-fsdp2",
    )
    if mon.port is None:
        print(f"EADDRINUSE: port {port} was taken before the endpoint bound it", flush=True)
        raise SystemExit(3)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1000 + info["data_seed"])
    if scaler is not None or args.strategy != "fsdp2" or args.collectives:
        if scaler is not None:
            steps = scaled_steps(model, opt, scaler, mon, params, gen)
        else:
            steps = plain_steps(model, opt, mon, params, gen)
        text = scrape(mon.port)
        Path(args.out, f"rank{rank}.metrics").write_text(text)
        result = {"rank": rank, "steps": steps, "counts": counts}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
        mon.close()
        destroy_process_group_now()
        return
    steps = []
    for step in range(NAN_AT + 1 + AFTER):
        micro = 2 if CLEAN_STEPS <= step < NAN_AT else 1
        if step == NAN_AT and rank == 1:
            _poison_next_grad(model.get_submodule(NAN_PARAM.rsplit(".", 1)[0]))
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            loss = model(torch.randn(4, D, generator=gen)).square().mean()
            mon.observe_loss(loss)
            loss.backward()
        reference = pre_clip_norm(params)
        if step in (2, 3):
            returned = float(_full(ddpmon.clip_grad_norm_(params, MAX_NORM)))
        else:
            returned = float(_full(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        text = scrape(mon.port)
        steps.append(
            {
                "step": step,
                "reference": reference,
                "clip_returned": returned,
                "grad_norm": value(text, "ddpmon_grad_norm"),
                "grad_local_norm": value(text, "ddpmon_grad_local_norm"),
                "steps_total": value(text, "ddpmon_steps_total"),
            }
        )
    text = scrape(mon.port)
    Path(args.out, f"rank{rank}.metrics").write_text(text)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps}))
    mon.close()
    destroy_process_group_now()


if __name__ == "__main__":
    main()
