"""No false pages from the replica checksums: long clean runs under every strategy with replicas,
each a real gloo job on this machine, counting the mismatches the agents report (must be 0).

Variants: DDP fp32; DDP with bf16 autocast and accumulation over two ``no_sync`` micro-batches;
HSDP (2 x 2 mesh) fp32 and bf16 with accumulation; DeepSpeed ZeRO-2 fp32 and bf16. AdamW
everywhere (DeepSpeed: its own), a check every ``--every`` steps (default 10: ten times the
default interval's checks).

Usage: python scripts/replica_soak.py [--steps 10000] [--every 10] [--variants ddp,...]
(``make replica-soak``; ranks are launched by this script, ``--worker`` is internal).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {  # name -> (ranks, bf16 + accumulation)
    "ddp": (2, False),
    "ddp-bf16-accum": (2, True),
    "hsdp": (4, False),
    "hsdp-bf16-accum": (4, True),
    "zero2": (2, False),
    "zero2-bf16": (2, True),
}


def _net():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ddpmon

    variant, (_, low) = args.variant, VARIANTS[args.variant]
    torch.set_num_threads(1)
    if variant.startswith("zero2"):
        import deepspeed

        deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    net = _net()
    options = dict(port=0, run_dir=args.out, run_id=f"soak-{variant}",
                   replica_check_every=args.every, data_check_interval=0)
    gen = torch.Generator().manual_seed(100 + rank)

    def batch():
        return torch.randn(8, 32, generator=gen)

    if variant.startswith("zero2"):
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": low}}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=config)
        mon = ddpmon.attach(engine, **options)
        for _ in range(args.steps):
            x = batch().to(torch.bfloat16) if low else batch()
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
    else:
        if variant.startswith("hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                    mesh_dim_names=("replicate", "shard"))
            fully_shard(net[0], mesh=mesh)
            fully_shard(net, mesh=mesh)
            model = net
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = ddpmon.attach(model, opt, **options)
        for _ in range(args.steps):
            opt.zero_grad()
            for micro in range(2 if low else 1):
                last = micro == (1 if low else 0)
                sync = contextlib.nullcontext()
                if not last and hasattr(model, "no_sync"):
                    sync = model.no_sync()
                elif not last:  # FSDP2: keep the unsharded gradients until the last micro-batch
                    model.set_requires_gradient_sync(False)
                cast = (torch.autocast("cpu", dtype=torch.bfloat16) if low
                        else contextlib.nullcontext())
                with sync, cast:
                    model(batch()).float().pow(2).mean().backward()
                if not last and not hasattr(model, "no_sync"):
                    model.set_requires_gradient_sync(True)
            opt.step()
    mon.flush()
    result = {"rank": rank, "mismatches": mon.state.replica_mismatch_total,
              "errors": {k: v for k, v in mon.state.agent_errors.items() if v},
              "steps": mon.state.steps_total}
    mon.close()
    Path(args.out, f"result.{variant}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, steps: int, every: int, out: str) -> dict:
    world = VARIANTS[variant][0]
    port = _free_port()
    procs = []
    start = time.perf_counter()
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        # DeepSpeed's ops as `make` builds them, in this venv (not a shared cache)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--variant", variant, "--steps", str(steps),
             "--every", str(every), "--out", out], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=7200)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{variant}: a rank failed:\n" + "\n".join(e[-2000:] for e in errs))
    ranks = [json.loads(Path(out, f"result.{variant}.{r}.json").read_text())
             for r in range(world)]
    return {"variant": variant, "ranks": world, "steps": ranks[0]["steps"],
            "checks": ranks[0]["steps"] // every + (ranks[0]["steps"] % every > 0),
            "mismatches": sum(r["mismatches"] or 0 for r in ranks),
            "errors": sum(sum(r["errors"].values()) for r in ranks),
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print("| variant | ranks | steps | checks | mismatches | probe errors | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    failed = False
    with tempfile.TemporaryDirectory() as out:
        for variant in args.variants.split(","):
            r = run_variant(variant, args.steps, args.every, out)
            failed |= bool(r["mismatches"] or r["errors"])
            print(f"| {variant} | {r['ranks']} | {r['steps']} | {r['checks']} | "
                  f"{r['mismatches']} | {r['errors']} | {r['seconds']} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
