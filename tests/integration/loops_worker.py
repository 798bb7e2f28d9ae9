"""One rank of the training-loop tests: loops written the way real scripts write them (guard and
skip, gradient accumulation with no_sync, closures, clipping, torch.compile, NaN propagation).
Records, per optimizer step, the reference norm torch computes and what ddpmon reported.

One process runs several cases one after another (``--case`` repeated), each with its own model,
optimizer, monitor and run id: starting ranks (torch import, process group) costs far more than
a case's few steps, so the tests share launches."""

import argparse
import datetime
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

POISON = "layers.1.weight"


def reference_norm(params) -> float:
    """What the user's own tools report: torch's clip_grad_norm_ (pre-clip, nothing clipped)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    return (total.full_tensor() if hasattr(total, "full_tensor") else total).item()


def poison_next_backward(param, value=float("nan")):
    handle = None

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    handle = param.register_hook(hook)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--case", action="append", required=True, metavar="ID:SCENARIO:STEPS:AT[:fsdp]",
        help="one case, run in order; its result is rank<R>.json[ID]",
    )
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    cases = []
    for spec in args.case:
        case_id, scenario, steps, at, *flags = spec.split(":")
        cases.append((case_id, argparse.Namespace(
            scenario=scenario, steps=int(steps), at=int(at), fsdp="fsdp" in flags, port=args.port,
            out=args.out,
        )))
    if any(case.scenario == "quiet" for _, case in cases):
        assert len(cases) == 1, "the quiet case checks the whole process's stderr"
        warnings.filterwarnings("error", module=r"ddpmon(\..*)?$")  # ddpmon's warnings: errors
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {case_id: run_case(case, rank, case_id) for case_id, case in cases}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results, default=_nan))
    dist.destroy_process_group()


def run_case(args: argparse.Namespace, rank: int, case_id: str) -> dict:
    """One case on a fresh model, optimizer and monitor; returns what the tests check."""
    torch.manual_seed(0)
    inner = nn.Sequential()
    inner.add_module("layers", nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))
    plain = args.scenario in ("closure_plain", "clip_plain")
    if args.scenario == "compile":  # nanoGPT's order: compile the module, then wrap it in DDP
        model = DistributedDataParallel(torch.compile(inner, backend="aot_eager"))
    elif plain:
        model = inner
    elif args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in inner.layers:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(inner, mesh=mesh)
    else:
        model = DistributedDataParallel(inner, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    import ddpmon

    # inf_one_rank: rank 1's gradients overflow on every step from --at; a GradScaler absorbs it
    scaler = None
    if args.scenario == "inf_one_rank":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    mon = ddpmon.attach(
        model,
        opt,
        scaler,
        port=args.port,
        bind="127.0.0.1",
        run_dir=str(Path(args.out) / "runs"),
        run_id=case_id,
        data_check_interval=3,
        local_norm_every=2,
        announce=args.scenario == "quiet",
        on_nonfinite="skip" if args.scenario == "skip_policy" else "record",
    )
    params = list(inner.parameters())
    poison_param = dict(inner.named_parameters())[POISON]
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    accum = 2 if args.scenario == "accum" else 1
    for step in range(args.steps):
        entry = {"step": step}
        if args.scenario == "closure_plain":

            def closure(entry=entry):
                opt.zero_grad()
                loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
                mon.observe_loss(loss)
                loss.backward()
                entry["ref"] = reference_norm(params)
                return loss

            opt.step(closure)
            entry["ddpmon"] = mon.state.grad_norm
            steps.append(entry)
            continue
        for micro in range(accum):
            x = torch.randn(8, 16, generator=g)
            nan_batch = args.scenario in ("guard", "skip_policy")
            if nan_batch and step == args.at and rank == 1:
                x[0, 0] = float("nan")  # this rank's batch holds a NaN (FSDP2: no tensor hooks)
            last = micro == accum - 1
            if args.scenario == "propagate" and step == args.at and rank == 1:
                poison_next_backward(poison_param)
            if args.scenario == "inf_one_rank" and step >= args.at and rank == 1:
                poison_next_backward(poison_param, float("inf"))
            ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else _null()
            with ctx:
                loss = model(x).pow(2).mean() / accum
                if micro == 0:
                    mon.observe_loss(loss)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        entry["ref"] = reference_norm(params)
        if args.scenario == "guard":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if torch.isfinite(norm):
                opt.step()
            opt.zero_grad()
        elif args.scenario == "clip_plain":
            entry["clip_returned"] = torch.nn.utils.clip_grad_norm_(params, 0.01).item()
            opt.step()
            opt.zero_grad()
        elif scaler is not None:
            scaler.unscale_(opt)
            entry["ref"] = reference_norm(params)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        steps.append(entry)
    # Per-step ddpmon norms: on CPU a step's record is read back as the step completes, but a
    # loop-skipped step completes at the next forward, so take them from the step records.
    mon.close()
    by_step = {r.step: r.grad_norm for r in mon.recent_steps()}
    for entry in steps:
        entry.setdefault("ddpmon", by_step.get(entry["step"]))
    s = mon.state
    result = {
        "steps": steps,
        "steps_total": s.steps_total,
        "nonfinite_steps": s.grad_nonfinite_steps_total,
        "origin_steps": s.grad_nonfinite_origin_steps_total,
        "poisoned_steps": s.grad_nonfinite_poisoned_steps_total,
        "loss_nonfinite": s.loss_nonfinite_total,
        "first_nonfinite": (
            {"step": s.first_nonfinite.step, "param": s.first_nonfinite.param}
            if s.first_nonfinite
            else None
        ),
        "agent_errors": {k: v for k, v in s.agent_errors.items() if v},
        "strategy": s.strategy,
        "skipped": s.amp_skipped_steps_total,
        "steps_skipped": dict(s.steps_skipped_total),
        "params_finite": all(
            bool(torch.isfinite(getattr(p, "full_tensor", lambda p=p: p)()).all()) for p in params
        ),
    }
    return result


def _nan(value):
    return str(value)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
