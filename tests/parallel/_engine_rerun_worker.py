"""One rank of the DeepSpeed rerun check (``on_nonfinite='rerun'``): real gloo ranks, ZeRO-2 in
fp32 on CPU (``DS_ACCELERATOR=cpu``), the loop handing each step's forward and backward to
``mon.run_step(closure)`` before ``engine.step()``. A NaN in ``TRANSIENT_RANK``'s loss at the
first backward of ``TRANSIENT_STEP`` (its rerun is clean); a batch that always fails on
``BAD_RANK`` at ``BAD_STEP``.

Writes ``OUT/rank<R>.json``: the ``rerun`` events, the error raised, the engine's step counters,
the backward calls per step, probe errors, the weights (whether they stayed finite, and their
values, to compare with a run without the transient fault: ``--no-transient``)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import ddpmon
from ddpmon.errors import NonFiniteGradientError
from tests.parallel._replica_worker import Net
from tests.parallel._rerun_worker import write_result

TRANSIENT_STEP, TRANSIENT_RANK = 2, 1
BAD_STEP, BAD_RANK = 5, 0
STEPS = 8
RUN_ID = "test-engine-reruns"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-transient", dest="transient", action="store_false",
                    help="the reference run: the same steps without the one-off NaN")
    args = ap.parse_args()
    out = Path(args.out)
    deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {
        "type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    mon = ddpmon.attach(engine, port=0, run_dir=str(out / "runs"), run_id=RUN_ID,
                        on_nonfinite="rerun")
    gen = torch.Generator().manual_seed(100 + rank)
    calls: dict[int, int] = {}
    error = None
    try:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=gen)
            mon.observe_samples([step * 100 + rank * 4 + i for i in range(4)])

            def forward_backward(x=x, step=step):
                loss = engine(x).pow(2).mean()
                n = calls[step] = calls.get(step, 0) + 1
                if (args.transient and rank == TRANSIENT_RANK and step == TRANSIENT_STEP
                        and n == 1) or (
                        rank == BAD_RANK and step == BAD_STEP):
                    loss = loss * float("nan")
                engine.backward(loss)
                return loss

            mon.run_step(forward_backward)
            engine.step()
    except NonFiniteGradientError as exc:
        error = str(exc)
    params = list(engine.module.parameters())
    write_result(mon, out, RUN_ID, rank, error=error, calls=calls,
                 global_steps=engine.global_steps, skipped_steps=engine.skipped_steps,
                 finite=all(bool(torch.isfinite(p).all()) for p in params),
                 weights=[p.detach().reshape(-1).tolist() for p in params])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
