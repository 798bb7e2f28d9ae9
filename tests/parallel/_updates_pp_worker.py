"""One rank of the pipeline-parallel update-figure check: the tiny transformer split in two
``torch.distributed.pipelining`` stages (embedding + encoder block | head) over 2 gloo ranks,
1F1B with 2 micro-batches, each rank's stage stepped by its own AdamW, ``ddpmon.attach(stage,
opt, schedule=..., update_every=2)``. The reference (tests/support/updates.py) computes each
step's per-group figures from the stage's full tensors before and after the step. Writes both to
--out; the assertions live in tests/parallel/test_update_figures.py.

Run as: ``python _updates_pp_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (tests/support/ranks.py), 2 ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import ddpmon
from tests.parallel._worker import destroy_process_group_now
from tests.support.updates import VOCAB, Reference, TinyTransformer, batch

STEPS = 6
EVERY = 2
MICROBATCHES = 2


class First(nn.Module):
    def __init__(self, whole: TinyTransformer) -> None:
        super().__init__()
        self.emb, self.block = whole.emb, whole.block

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(tokens))


class Last(nn.Module):
    def __init__(self, whole: TinyTransformer) -> None:
        super().__init__()
        self.head = whole.head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = TinyTransformer()
    module = First(whole) if rank == 0 else Last(whole)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    mon = ddpmon.attach(module, opt, schedule=schedule, port=0, announce=False,
                        run_dir=os.path.join(args.out, "pp"), update_every=EVERY)
    reference = Reference(module, opt)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        tokens, targets = batch(gen)
        if rank == 0:
            schedule.step(tokens)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses)
            mon.observe_loss(torch.stack(losses).mean())
        opt.step()
        opt.zero_grad()
    measured = {r.step: r.update_stats for r in mon.recent_steps() if r.update_stats}
    result = {"strategy": mon.strategy, "measured": measured, "reference": reference.steps,
              "errors": {k: v for k, v in mon.state.agent_errors.items() if v}}
    mon.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pp": result}))
    destroy_process_group_now()


if __name__ == "__main__":
    main()
