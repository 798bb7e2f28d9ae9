"""The demo rank: a small transformer learning a shift task, DDP over gloo, a GradScaler,
monitored by ddpmon. Launched by ``ddpmon demo`` under torchrun.

It computes in fp32 unless ``--autocast float16|bfloat16`` asks otherwise: the GradScaler's
protocol (scale, unscale, the inf check, skip and back-off) is the same under any compute dtype,
and a CPU without fp16/bf16 matmul units runs an autocast step about 5x slower (3.6 s against
0.65 s for 60 steps of this model on an AVX2-only EPYC)."""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpmon

from . import AUTOCAST_DTYPES
from .checkpointing import (
    CheckpointRefused,
    DemoCheckpoints,
    add_checkpoint_arguments,
    first_attempt,
    init_process_group,
)
from .faults import FaultPlan

VOCAB, SEQ = 64, 32


class TinyTransformer(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(SEQ, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))


def batch(
    step: int, shard: int, world: int, global_batch: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``shard``'s slice of step ``step``'s global batch. The global batch depends only on
    (seed, step), so runs with the same global batch over 1 or N ranks see the same samples."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    micro = global_batch // world
    x = x[shard * micro : (shard + 1) * micro]
    return x, (x + 1) % VOCAB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="global batch split over the ranks (overrides --batch-size; divisible by ranks)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (seconds)")
    p.add_argument("--inject", action="append", default=[], help="fault spec, repeatable")
    p.add_argument("--no-amp", action="store_true", help="fp32 without GradScaler")
    p.add_argument("--autocast", choices=AUTOCAST_DTYPES, default="none",
                   help="compute dtype under torch.autocast (default none: fp32 compute, the "
                   "GradScaler still scaling)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--run-id", default=None)
    p.add_argument("--sd-dir", default=None)
    p.add_argument("--daemon-url", default=None)
    p.add_argument("--on-nonfinite", default=None)
    p.add_argument("--replica-check-every", type=int, default=None)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--hold", type=float, default=0.0, help="keep serving N s after the last step")
    p.add_argument("--linger", type=float, default=6.0, help="the agent's linger_seconds")
    p.add_argument("--seed", type=int, default=0)
    add_checkpoint_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    init_process_group(datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    global_batch = args.global_batch or args.batch_size * world
    if global_batch % world:
        print(f"--global-batch {global_batch} is not divisible by {world} ranks", file=sys.stderr)
        return 2
    faults = FaultPlan(args.inject if first_attempt() else [], rank)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(TinyTransformer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rerun = args.on_nonfinite == "rerun"
    amp = not args.no_amp and not rerun  # a GradScaler takes no closure: rerun trains in fp32
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=amp)
    autocast_dtype = None if args.autocast == "none" else getattr(torch, args.autocast)
    options = {
        k: v
        for k, v in {
            "port": args.port,
            "run_dir": args.run_dir,
            "run_id": args.run_id,
            "sd_dir": args.sd_dir,
            "daemon_url": args.daemon_url,
            "on_nonfinite": args.on_nonfinite,
            "replica_check_every": args.replica_check_every,
            "linger_seconds": args.linger,
        }.items()
        if v is not None
    }
    mon = ddpmon.attach(model, optimizer, scaler if amp else None, **options)
    mon.annotate(
        global_batch=global_batch, micro_batch=global_batch // world, accumulation=1, seed=args.seed
    )
    checkpoints = DemoCheckpoints(args, rank)
    try:
        start = checkpoints.resume(model.module, optimizer, scaler, amp, mon)
    except CheckpointRefused as exc:
        print(f"[rank {rank}] {exc}", file=sys.stderr, flush=True)
        mon.close()
        return 2
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, args.steps):
        shard = faults.data_rank(step)
        x, y = batch(step, shard, world, global_batch, args.seed)
        micro = global_batch // world
        mon.observe_samples(range(step * global_batch + shard * micro,
                                  step * global_batch + (shard + 1) * micro))
        if rerun:  # the step handed over as a closure, so ddpmon can run it again

            def closure(x=x, y=y, step=step):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1))
                mon.observe_loss(loss)
                faults.before_backward(step, model)
                loss.backward()
                return loss

            optimizer.step(closure)
            optimizer.zero_grad(set_to_none=True)
            faults.after_step(step, model)
            checkpoints.after_step(step, model.module, optimizer, scaler, mon)
            if args.step_delay:
                time.sleep(args.step_delay)
            continue
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)
            loss = loss_fn(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        mon.observe_loss(loss)
        faults.before_backward(step, model)
        if amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        faults.after_step(step, model)
        checkpoints.after_step(step, model.module, optimizer, scaler, mon)
        if args.step_delay:
            time.sleep(args.step_delay)
    if args.hold:
        time.sleep(args.hold)
    mon.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
