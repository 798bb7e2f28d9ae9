"""One rank of the "late peer" check: does the training thread wait for another rank to reach
ddpmon's small norm all-reduce?

Two gloo ranks, FSDP2. At step 1, rank 1 reaches ddpmon's reduction late: its measurement waits
(up to ``HOLD_S``) until rank 0 says its ``optimizer.step()`` has returned. With the default
``on_nonfinite='record'`` nothing on rank 0's training thread needs the reduced norms, so its
step returns at once (the record thread finishes the reduction); with ``'skip'`` the policy must
read them before the step, so rank 0 waits and rank 1's hold runs out. Either way every step's
norm equals torch's ``clip_grad_norm_`` (``max_norm=inf``) over the same gradients.

Run as ``python _deferred_worker.py --out DIR --policy record|skip`` under ``launch``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ddpmon
from tests.parallel._worker import D, Net, _full, destroy_process_group_now

STEPS = 3
LATE_STEP = 1
HOLD_S = {"record": 30.0, "skip": 3.0}
KEY = "rank0-step-returned"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--policy", choices=sorted(HOLD_S), required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = ddpmon.attach(
        model, opt, port=0, run_dir=os.path.join(args.out, "runs"),
        run_id=f"test-deferred-{args.policy}", on_nonfinite=args.policy,
    )
    params = list(model.parameters())
    peer_saw_return: bool | None = None
    hold_error: str | None = None
    if rank == 1:  # a straggler reaching ddpmon's reduction late, at LATE_STEP only
        norms = mon.source._norms
        measure = norms.measure

        def late_measure(scaled: bool):
            nonlocal peer_saw_return, hold_error
            if mon.step == LATE_STEP:
                try:
                    store.wait([KEY], datetime.timedelta(seconds=HOLD_S[args.policy]))
                    peer_saw_return = True
                except Exception as exc:  # the hold ran out: rank 0 was still in its step
                    peer_saw_return = False
                    hold_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            return measure(scaled)

        norms.measure = late_measure
    gen = torch.Generator().manual_seed(100 + rank)
    torch_norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.randn(4, D, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        if rank == 0 and step == LATE_STEP:
            store.set(KEY, "1")
        # SGD leaves the gradients as they were: torch's own norm of the step's gradients
        total = torch.nn.utils.clip_grad_norm_(params, float("inf"))
        torch_norms.append(float(_full(total)))
    records = mon.recent_steps()
    result = {
        "rank": rank,
        "peer_saw_return": peer_saw_return,
        "hold_error": hold_error,
        "torch": torch_norms,
        "ours": {r.step: r.grad_norm for r in records},
        "errors": dict(mon.state.agent_errors),
        "forced_waits": mon.flow.readback.forced_waits,
        "deferred_type": type(mon.source).__name__,
    }
    mon.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    destroy_process_group_now()


if __name__ == "__main__":
    main()
