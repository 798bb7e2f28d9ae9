"""One rank of the DeepSpeed update-figure check: the tiny transformer trained with a torch AdamW
under real DeepSpeed ZeRO 1, 2 and 3 in turn (2 gloo ranks, ``DS_ACCELERATOR=cpu``, fp32),
``ddpmon.attach(engine, update_every=2)`` each. The reference wraps the ZeRO optimizer's ``step``
outside ddpmon's wrapper and reads the full fp32 master weights and optimizer moments with
DeepSpeed's own gathers (``deepspeed.utils.safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``) before and after each step. Writes both to --out; the
assertions live in tests/parallel/test_update_figures.py.

Run as: ``python _updates_ds_worker.py --out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (tests/support/ranks.py), 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import ddpmon  # noqa: E402
from tests.support.updates import (  # noqa: E402
    TinyTransformer,
    add_squares,
    batch,
    figures_of,
    loss_of,
)

STEPS = 6
EVERY = 2
STAGES = ("zero1", "zero2", "zero3")


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1200},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class ZeroReference:
    """Per-group figures of every step from DeepSpeed's full fp32 master weights and moments,
    around the ZeRO optimizer's ``step`` (wrapped outside ddpmon's wrapper)."""

    def __init__(self, engine) -> None:
        self.named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.steps: list[dict] = []
        zero = engine.optimizer
        inner = zero.step

        def step(*args, **kwargs):
            before = [self._full(p) for _, p in self.named]
            result = inner(*args, **kwargs)
            self._record(before)
            return result

        zero.step = step

    @staticmethod
    def _full(p, key: str | None = None) -> torch.Tensor:
        value = (safe_get_full_fp32_param(p) if key is None
                 else safe_get_full_optimizer_state(p, key))
        return value.detach().to(torch.float64).clone()

    def _record(self, before: list[torch.Tensor]) -> None:
        sums: dict[str, dict[str, float]] = {}
        for (name, p), was in zip(self.named, before, strict=True):
            after = self._full(p)
            parts = {"weight_norm": after, "update_norm": after - was,
                     "exp_avg_norm": self._full(p, "exp_avg"),
                     "exp_avg_sq_norm": self._full(p, "exp_avg_sq")}
            add_squares(sums, name.split(".")[0], parts)
        self.steps.append(figures_of(sums))


def run(name: str, out: Path, rank: int) -> dict:
    torch.manual_seed(0)
    net = TinyTransformer()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt,
                                           config=ds_config(int(name[-1])))
    mon = ddpmon.attach(engine, port=0, run_dir=str(out / name), update_every=EVERY)
    reference = ZeroReference(engine)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(STEPS):
        tokens, targets = batch(gen)
        loss = loss_of(engine, tokens, targets)
        mon.observe_loss(loss)
        engine.backward(loss)
        engine.step()
    measured = {r.step: r.update_stats for r in mon.recent_steps() if r.update_stats}
    result = {"strategy": mon.strategy, "measured": measured, "reference": reference.steps,
              "errors": {k: v for k, v in mon.state.agent_errors.items() if v}}
    mon.close()
    engine.destroy()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {name: run(name, args.out, rank) for name in STAGES}
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **results}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
