"""One rank of the HSDP rerun check (``on_nonfinite='rerun'``): real gloo ranks, FSDP2 on a
2 x 2 mesh (replicate x shard), a closure loop. A NaN in ``TRANSIENT_RANK``'s loss at the first
backward of ``TRANSIENT_STEP`` (its rerun is clean); a batch that always fails on ``BAD_RANK`` at
``BAD_STEP`` (every rank raises ``NonFiniteGradientError`` there).

Writes ``OUT/rank<R>.json``: the ``rerun`` events, the error raised, the steps, probe errors."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

import ddpmon
from ddpmon.agent.policy import NonFiniteGradientError
from tests.parallel._replica_worker import Net

TRANSIENT_STEP, TRANSIENT_RANK = 3, 1
BAD_STEP, BAD_RANK = 6, 2
STEPS = 9
RUN_ID = "test-reruns"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
    fully_shard(net.embed, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    mon = ddpmon.attach(net, opt, port=0, run_dir=str(out / "runs"), run_id=RUN_ID,
                        on_nonfinite="rerun")
    gen = torch.Generator().manual_seed(100 + rank)
    calls: dict[int, int] = {}
    error = None
    try:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=gen)
            mon.observe_samples([step * 100 + rank * 4 + i for i in range(4)])

            def closure(x=x, step=step):
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                n = calls[step] = calls.get(step, 0) + 1
                if (rank == TRANSIENT_RANK and step == TRANSIENT_STEP and n == 1) or (
                        rank == BAD_RANK and step == BAD_STEP):
                    loss = loss * float("nan")
                loss.backward()
                return loss

            opt.step(closure)
    except NonFiniteGradientError as exc:
        error = str(exc)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in net.parameters())
    write_result(mon, out, RUN_ID, rank, error=error, calls=calls, finite=finite)
    dist.barrier()
    dist.destroy_process_group()


def write_result(mon, out: Path, run_id: str, rank: int, **facts) -> None:
    """``OUT/rank<R>.json``: the rank's ``rerun`` events, its steps and probe errors, and
    ``facts`` (the error raised, the closure's calls per step...)."""
    mon.flush()
    state = mon.state
    events = [json.loads(line) for line in (
        out / "runs" / run_id / f"events.rank{rank}.jsonl").read_text().splitlines()]
    result = {
        "rank": rank,
        "reruns": [e for e in events if e["kind"] == "rerun"],
        "steps": state.steps_total,
        "errors": {k: v for k, v in state.agent_errors.items() if v},
        **facts,
    }
    mon.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
