"""One rank of the goodput test, run by torchrun (gloo, ``--max-restarts 3``): a DDP loop that
checkpoints every 10 steps, resumes from the newest checkpoint, and fails once per attempt the
way real jobs fail. It keeps its own record of when it was born and when each step ran
(``truth.rank<R>.jsonl``, one unbuffered line per step, so a SIGKILL loses none), which the test
compares with ddpmon's goodput. A step's length is timed on ``perf_counter`` (``took``), as ddpmon
times it: this machine's wall clock can step mid-run; its wall-clock ends place the steps only.

Faults (by ``TORCHELASTIC_RESTART_COUNT``): attempt 0, rank 1 SIGKILLs itself at step 25;
attempt 1, rank 2 poisons its gradient with NaN at step 37 (``on_nonfinite="raise"`` raises on
every rank); attempt 2, rank 3 hangs at step 48 (the stall watchdog records it; the others'
collective times out after 15 s and torchrun restarts all); attempt 3 finishes."""

import time

BORN = time.time()  # before the imports: initialisation is counted from here

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import ddpmon  # noqa: E402
from ddpmon.demo.checkpointing import init_process_group  # noqa: E402

CHECKPOINT_EVERY = 10
HANG_TIMEOUT = 15
FAULTS = {0: (1, 25, "kill"), 1: (2, 37, "nan"), 2: (3, 48, "hang")}


class Truth:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **fields) -> None:
        os.write(self.fd, (json.dumps(fields) + "\n").encode())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-seconds", type=float, default=0.04)
    args = p.parse_args()
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    # rendezvous keys private to the attempt; a hang ends at this collective timeout
    init_process_group(datetime.timedelta(seconds=HANG_TIMEOUT))
    rank = dist.get_rank()
    truth = Truth(out / f"truth.rank{rank}.jsonl")
    truth.write(kind="born", attempt=attempt, t=BORN)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(out / "runs"), run_id="gp",
                        stall_seconds=1.0, on_nonfinite="raise", linger_seconds=0.0)
    assert mon.enabled, mon.error
    ckpt = out / "ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        with mon.observe_checkpoint(state["step"], ckpt, "load", model=True, optimizer=True,
                                    scaler=True, rng=True, data_loader=True):
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        start = state["step"]
    fault = FAULTS.get(attempt)
    gen = torch.Generator().manual_seed(rank)
    for step in range(start, args.steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen)
        t0, p0 = time.time(), time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        time.sleep(args.step_seconds)  # the step's compute, made long enough to time
        if fault and fault[:2] == (rank, step):
            if fault[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault[2] == "hang":
                while True:
                    time.sleep(3600)
            if fault[2] == "nan":
                w = model.module[0].weight
                w.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
        loss.backward()
        opt.step()
        opt.zero_grad()
        truth.write(kind="step", attempt=attempt, step=step, start=t0, end=time.time(),
                    took=time.perf_counter() - p0)
        if (step + 1) % CHECKPOINT_EVERY == 0:
            with mon.observe_checkpoint(step + 1, ckpt, "save", model=True, optimizer=True,
                                        scaler=True, rng=True, data_loader=True):
                if rank == 0:
                    tmp = out / "ckpt.tmp"
                    torch.save({"step": step + 1, "model": model.module.state_dict(),
                                "optimizer": opt.state_dict()}, tmp)
                    os.replace(tmp, ckpt)
                dist.barrier()
    mon.close()
    dist.barrier()
    dist.destroy_process_group()
    truth.write(kind="done", attempt=attempt, t=time.time())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
