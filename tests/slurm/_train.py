"""The training script of the Slurm tests, written as a user's would be: DDP over gloo, one
``ddpmon.attach`` line, configuration from ``DDPMON_*`` in the job script. Under ``srun``
without torchrun it takes its rank from ``SLURM_PROCID`` for ``init_process_group`` (its own
business); ddpmon reads the rest from Slurm's environment.

``--nan RANK:STEP`` poisons one gradient on that rank at that step; with ``--nan-gate PATH``
that rank first waits at that step until PATH exists (the test creates it once Prometheus
scrapes every rank, so that the page can name the origin; the other ranks wait in the next
all-reduce, serving /metrics meanwhile). Writes
``OUT/rank<R>.attempt<A>.json``: what ddpmon settled (identity, run id, attempt), and when the
process was born (its own clock, read before torch's import)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

BORN = time.time()  # before torch's import: the goodput test's clock of this process's start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import ddpmon  # noqa: E402


def wait_for_gate(gate: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not gate.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{gate} did not appear in {timeout:g} s")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-delay", type=float, default=0.1)
    ap.add_argument("--nan", default=None)
    ap.add_argument("--nan-gate", default=None)
    args = ap.parse_args()
    timeout = datetime.timedelta(seconds=120)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timeout)
    else:  # srun: one task per rank
        dist.init_process_group(
            "gloo", timeout=timeout,
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt)
    nan_rank, nan_step = map(int, args.nan.split(":")) if args.nan else (-1, -1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        if step == nan_step and dist.get_rank() == nan_rank:
            if args.nan_gate:
                wait_for_gate(Path(args.nan_gate), timeout=180.0)
            model.module[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(args.step_delay)
    ident = mon.identity
    facts = {"rank": ident.rank, "local_rank": ident.local_rank, "world_size": ident.world_size,
             "node": ident.node, "run_id": mon.run_id, "attempt": mon.attempt.number,
             "attempt_source": mon.attempt.source, "port": mon.port, "born": BORN}
    mon.close()
    out = Path(args.out) / f"rank{ident.rank}.attempt{facts['attempt']}.json"
    out.write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
