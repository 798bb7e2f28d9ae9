"""One rank of the exit-path tests: a DDP training loop as public scripts write it (a Dataset, a
DataLoader, ``clip_grad_norm_``, a loss guard), with one fault on rank 1 at step ``--at``:

- ``clip``: a NaN in rank 1's input; ``clip_grad_norm_(..., error_if_nonfinite=True)`` raises on
  both ranks;
- ``guard``: a NaN in rank 1's input; the loop's own guard raises on rank 1
  (``if not torch.isfinite(loss): raise``);
- ``dataset``: the Dataset's ``__getitem__`` raises ``ValueError`` on rank 1's first sample of
  the step;
- ``oom``: the model's forward raises ``torch.OutOfMemoryError`` on rank 1;
- ``sigterm``: rank 1 is stopped by SIGTERM in its forward (a preemption);
- ``sigkill``: rank 1 is killed by SIGKILL in its forward (the OOM killer, a launcher's kill);
- ``skip``: a NaN in rank 1's input; the loop skips the step itself (guard and skip) and goes on.

The script's own numbers go to ``OUT/rank<R>.json`` as they happen (the step it started, the
steps it completed, the NaN it saw), so a rank that dies still leaves them."""

import argparse
import datetime
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

BATCH = 4


class Samples(Dataset):
    """Each rank's own samples; sample ``bad`` (if any) carries a NaN, and from ``broken`` on
    every sample fails to load."""

    def __init__(self, n: int, rank: int, bad: int = -1, broken: int = -1) -> None:
        self.n, self.rank, self.bad, self.broken = n, rank, bad, broken

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if 0 <= self.broken <= i:
            raise ValueError(f"sample {i}: corrupt record in shard {self.rank}")  # DATA-FAULT
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x = torch.randn(16, generator=g)
        if i == self.bad:
            x[3] = float("nan")
        return x, x.sum(0, keepdim=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)
        self.fault: str | None = None

    def forward(self, x):
        if self.fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if self.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if self.fault == "sigkill":  # what the OOM killer, or a launcher's last resort, does
            os.kill(os.getpid(), signal.SIGKILL)
        return self.head(torch.relu(self.embed(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fault", required=True)
    p.add_argument("--at", type=int, default=10)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    p.add_argument("--late", type=float, default=0.0,
                   help="rank 1 is this many seconds slower after the fault step's backward, so "
                   "rank 0's exception is written first")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    faulty = rank == 1
    first = args.at * BATCH  # rank 1's first sample of step --at
    data = Samples(args.steps * BATCH, rank,
                   bad=first if faulty and args.fault in ("clip", "guard", "skip") else -1,
                   broken=first if faulty and args.fault == "dataset" else -1)
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    torch.manual_seed(0)
    net = Net()
    if args.fsdp:  # FSDP2, as the torchtitan-style scripts shard: each block, then the root
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(net.embed, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    import ddpmon

    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1",
                        run_dir=str(Path(args.out) / "runs"),
                        run_id=args.fault + ("-fsdp" if args.fsdp else ""))
    mine = {"started": None, "completed": 0, "skipped": [], "loss_nan_at": None,
            "params": [n for n, _ in net.named_parameters()]}
    out = Path(args.out) / f"rank{rank}.json"

    def note(**kw) -> None:
        mine.update(kw)
        out.write_text(json.dumps(mine))

    for step, (x, y) in enumerate(loader):
        note(started=step)
        if faulty and step == args.at and args.fault in ("oom", "sigterm", "sigkill"):
            net.fault = args.fault
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        if args.fault == "guard" and not torch.isfinite(loss):
            note(loss_nan_at=step)
            raise RuntimeError(f"Loss is {loss.item()} at step {step}, stopping training")
        loss.backward()
        if faulty and step == args.at and args.late:
            time.sleep(args.late)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0,
                                              error_if_nonfinite=args.fault == "clip")
        if args.fault == "skip" and not math.isfinite(norm.item()):
            note(skipped=[*mine["skipped"], step])
            continue  # guard and skip: the next zero_grad drops the gradients
        opt.step()
        note(completed=mine["completed"] + 1)
    mon.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
