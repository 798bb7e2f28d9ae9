"""One rank of the DDP-on-a-subgroup check: 4 ranks, two data-parallel groups {0, 1} and {2, 3}
(DDP beside pipeline or tensor parallelism holds such a group), each DDP module on its own
group, ddpmon attached. After each step every rank's parameters must equal a reference stepped
by hand from the gradients averaged over the rank's own group only; a reduction over all 4
ranks (ddpmon's hook falling back to the default group) mixes the other group's gradients in.
Writes what it saw to --out; the assertions live in tests/parallel/test_ddp_subgroup.py.

Run as: ``python _ddp_subgroup_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (tests/support/ranks.py), 4 ranks.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.parallel._worker import destroy_process_group_now

STEPS = 3
LR = 0.1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    group, _ = dist.new_subgroups(2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    reference = copy.deepcopy(net)
    model = DDP(net, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mon = ddpmon.attach(model, opt, port=0, run_dir=os.path.join(args.out, "runs"))
    gen = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    norms, ours = [], []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        reference.zero_grad()
        reference(x).pow(2).mean().backward()
        grads = [q.grad for q in reference.parameters()]
        for g in grads:  # the harness's own average over this rank's group only
            dist.all_reduce(g, group=group)
            g /= dist.get_world_size(group)
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        with torch.no_grad():
            for q, g in zip(reference.parameters(), grads, strict=True):
                q -= LR * g
        worst = max(worst, max(float((a - b).abs().max())
                               for a, b in zip(net.parameters(), reference.parameters(),
                                               strict=True)))
    ours = [r.grad_norm for r in mon.recent_steps()]
    mon.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "worst": worst, "norms": norms, "ours": ours}))
    del model, opt
    destroy_process_group_now()


if __name__ == "__main__":
    main()
