"""One rank of the agent's multi-process tests (gloo on 127.0.0.1), started by the test as a
plain process with RANK/WORLD_SIZE/MASTER_* set. Writes what it saw to --out for the test.

One process runs several cases in order (``--case`` repeated), each with its own model,
optimizer, scaler, monitor and run id: starting ranks costs far more than a case's steps."""

import argparse
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

import ddpmon
from ddpmon.agent import NonFiniteGradientError
from tests.support.scrape import sample
from tests.support.scrape import scrape_text as scrape

POISON_PARAM = "layers.2.weight"


def poison(model, value):
    param = dict(model.module.named_parameters())[POISON_PARAM]
    handle = None

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    handle = param.register_hook(hook)


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--case", action="append", required=True, metavar="ID:SCENARIO:STEPS:STEP",
        help="one case (STEP: the injection step), run in order",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    cases = []
    for spec in args.case:
        case_id, scenario, steps, step = spec.split(":")
        cases.append((case_id, argparse.Namespace(
            scenario=scenario, steps=int(steps), step=int(step), out=args.out, port=args.port
        )))
    # A raised NonFiniteGradientError leaves the ranks where the step stopped: nothing after it.
    assert all(c.scenario != "raise" for _, c in cases[:-1]), "the raise case must be last"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {case_id: run_case(case, rank, case_id) for case_id, case in cases}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    if all(r["raised"] is None for r in results.values()):
        dist.barrier()
    dist.destroy_process_group()
    return 0


def run_case(args: argparse.Namespace, rank: int, case_id: str) -> dict:
    """One case; the rank's scrape goes to ``<case_id>.rank<R>.metrics``."""
    torch.manual_seed(0)
    inner = nn.Sequential()
    inner.add_module("layers", nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]))
    # Small buckets: several all-reduces per step, so the per-bucket histogram is tested.
    model = DistributedDataParallel(inner, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp = args.scenario in ("nan", "collapse", "clean", "clip", "dupdata")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=amp)
    calls = {"n": 0}

    def user_hook(state, bucket):  # the user's own compression hook, composed by ddpmon
        calls["n"] += 1
        return fp16_compress_hook(state, bucket)

    policy = {"skip": "skip", "raise": "raise"}.get(args.scenario, "record")
    mon = ddpmon.attach(
        model,
        opt,
        scaler if amp else None,
        comm_hook=user_hook,
        comm_state=dist.group.WORLD,
        port=args.port,
        bind="127.0.0.1",
        run_dir=os.path.join(args.out, "runs"),
        run_id=f"test-{case_id}",
        on_nonfinite=policy,
        data_check_interval=2,
    )
    scales, raised, clip_checks = [], None, []
    import ddpmon.agent.clip as clip_module

    passes = {"n": 0}
    original_norms = clip_module.per_param_norms

    def counting_norms(tensors):  # counts passes over gradients made by clip_grad_norm_
        passes["n"] += 1
        return original_norms(tensors)

    clip_module.per_param_norms = counting_norms  # restored when the case ends
    ref_cache = {}

    def reference_params(grads):
        key = id(grads)
        if key not in ref_cache:
            ref_cache.clear()
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            ref_cache[key] = params
        return ref_cache[key]

    for step in range(args.steps):
        data_rank = 0 if args.scenario == "dupdata" and step >= args.step else rank
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 10 + data_rank))
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = model(x).float().pow(2).mean()
        mon.observe_loss(loss)
        if args.scenario in ("nan", "skip", "raise") and rank == 1 and step == args.step:
            poison(model, float("nan"))
        if args.scenario == "collapse" and rank == 0 and args.step <= step < args.step + 5:
            poison(model, float("inf"))
        try:
            if args.scenario == "clip":
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                reference = [p.grad.detach().clone() for p in model.parameters()]
                expected = torch.nn.utils.clip_grad_norm_(reference_params(reference), 0.05)
                total = ddpmon.clip_grad_norm_(model.parameters(), 0.05)
                clip_checks.append(
                    {
                        "ddpmon": total.item(),
                        "torch": expected.item(),
                        "max_grad_diff": max(
                            (p.grad - r.grad).abs().max().item()
                            for p, r in zip(
                                model.parameters(), reference_params(reference), strict=True
                            )
                        ),
                    }
                )
                scaler.step(opt)
                scaler.update()
                clip_checks[-1]["reported"] = sample(scrape(mon.port), "ddpmon_grad_norm")
            elif amp:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        except NonFiniteGradientError as exc:
            raised = str(exc)
            break
        opt.zero_grad(set_to_none=True)
        if args.scenario == "collapse":
            scales.append(sample(scrape(mon.port), "ddpmon_amp_loss_scale"))
    sharded = None
    passes_replicated = passes["n"]
    if args.scenario == "clip":
        # Each rank owns a disjoint slice of one logical parameter (FSDP-style sharding).
        shard = torch.nn.Parameter(torch.zeros(100))
        shard.grad = torch.randn(100, generator=torch.Generator().manual_seed(100 + rank))
        full = [torch.zeros(100) for _ in range(2)]
        dist.all_gather(full, shard.grad)
        expected = torch.cat(full).norm().item()
        total = ddpmon.clip_grad_norm_([shard], 1.0, sharded=True, monitor=False)
        sharded = {
            "ddpmon": total.item(),
            "expected": expected,
            "clipped_norm": torch.cat([shard.grad]).norm().item(),
        }
    text = scrape(mon.port)
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    Path(args.out, f"{case_id}.rank{rank}.metrics").write_text(text)
    mon.close()
    clip_module.per_param_norms = original_norms
    return {
        "run_id": f"test-{case_id}",
        "hook_calls": calls["n"],
        "scales": scales,
        "raised": raised,
        "params_sha256": digest,
        "params_finite": finite,
        "steps": args.steps,
        "clip": clip_checks,
        "clip_passes_replicated": passes_replicated,
        "sharded": sharded,
    }


if __name__ == "__main__":
    sys.exit(main())
