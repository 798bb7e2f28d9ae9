"""A DDP loop written the way scripts write it (a DataLoader, a loss all-reduced for logging, a
periodic evaluation and checkpoint), where one rank stops at step ``--at`` in one of five ways
(``--case``), then stays alive until killed:

- ``loader``: rank 3's dataset blocks in ``__getitem__`` (its data loader stops);
- ``skip``: rank 3 skips the logging all-reduce the others enter and waits in a barrier of a
  side group instead;
- ``user``: rank 3 spins in user code between forward and backward;
- ``mismatch``: rank 3 calls a broadcast where the others call the logging all-reduce (the same
  sequence number, another op: every rank waits);
- ``eval``: every rank runs an evaluation pass marked ``with mon.phase("eval")``; rank 3's lasts
  ``--hold`` seconds, the others wait for it in the evaluation's all-reduce;
- ``checkpoint``: rank 0 saves a checkpoint for ``--hold`` seconds (timed by
  ``mon.observe_checkpoint``), the others wait for it in the next step's all-reduce.
The quiet cases finish training after the hold and then idle until killed.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ddpmon

STOPPED = {"flag": False}


class Batches(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while STOPPED["flag"]:
            time.sleep(0.1)  # a shard that never arrives
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def wait_for_lock(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.1)  # a file lock nobody releases


def evaluate(model: nn.Module, seconds: float) -> torch.Tensor:
    end = time.monotonic() + seconds
    with torch.no_grad():
        total = model(torch.ones(4, 8)).sum()
        while time.monotonic() < end:
            time.sleep(0.1)
    return total


def save_checkpoint(model: nn.Module, path: str, seconds: float) -> None:
    torch.save(model.state_dict(), path)
    time.sleep(seconds)  # a slow file system


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--out", "--run-id", "--sd-dir", "--case"):
        p.add_argument(name, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--at", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=3.0)
    p.add_argument("--stall-seconds", type=float, default=300.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=args.port, bind="127.0.0.1", run_id=args.run_id,
                        run_dir=args.out, sd_dir=args.sd_dir, hang_seconds=args.hang_seconds,
                        stall_seconds=args.stall_seconds)
    loader = DataLoader(Batches(), batch_size=4)
    stuck = rank == 3 and args.case in ("loader", "skip", "user")
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        if stuck and args.case == "user" and step == args.at:
            wait_for_lock(os.path.join(args.out, "never"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        if stuck and args.case == "skip" and step == args.at:
            dist.barrier(group=side)  # skipped the all-reduce below
        elif rank == 3 and args.case == "mismatch" and step == args.at:
            dist.broadcast(logged, 0)  # another collective at the same sequence number
        else:
            dist.all_reduce(logged)
        if stuck and args.case == "loader" and step == args.at - 1:
            STOPPED["flag"] = True
        if args.case == "eval" and step == args.at:
            with mon.phase("eval"):
                total = evaluate(model, args.hold if rank == 3 else 0.0)
                dist.all_reduce(total)
        if args.case == "checkpoint" and step == args.at and rank == 0:
            with mon.observe_checkpoint(step, os.path.join(args.out, "ckpt.pt")):
                save_checkpoint(model, os.path.join(args.out, "ckpt.pt"), args.hold)
        time.sleep(0.05)
    with open(os.path.join(args.out, f"done{rank}"), "w") as fh:
        fh.write("trained\n")
    while True:
        time.sleep(1)  # alive until the test kills the group


if __name__ == "__main__":
    main()
