"""A 2-rank Lightning DDP run on CPU with ``DdpmonCallback(on_nonfinite="rerun")`` and nothing
else changed: Lightning hands its optimizer closure (training_step, zero_grad, backward) to
``optimizer.step(closure=...)``, which is what ddpmon reruns.

Rank ``--nan-rank`` gets a NaN in one local gradient at the first backward of step
``--nan-step`` only (a transient fault). Writes ``OUT/result.rank<R>.json``: the trainer's
steps, the backward passes per step, the rerun events and whether the weights stayed finite."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from ddpmon.integrations.lightning import DdpmonCallback
from tests.support.integrations import RUN_ID, agent_options


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nan-step", type=int, default=3)
    p.add_argument("--nan-rank", type=int, default=1)
    a = p.parse_args()
    out = Path(a.out)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.Linear(32, 4))
            self.backwards: dict[int, int] = {}

        def setup(self, stage: str) -> None:
            self.net[0].weight.register_hook(self._inject)

        def _inject(self, grad: torch.Tensor) -> torch.Tensor:
            step = self.trainer.global_step
            seen = self.backwards[step] = self.backwards.get(step, 0) + 1
            if self.trainer.global_rank == a.nan_rank and step == a.nan_step and seen == 1:
                return grad * float("nan")
            return grad

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Recorder(pl.Callback):
        def teardown(self, trainer, pl_module, stage) -> None:
            rank = trainer.global_rank
            events = out / "runs" / RUN_ID / f"events.rank{rank}.jsonl"
            lines = [json.loads(line) for line in events.read_text().splitlines()]
            result = {
                "rank": rank,
                "global_step": trainer.global_step,
                "backwards": pl_module.backwards,
                "reruns": [e for e in lines if e["kind"] == "rerun"],
                "finite": all(bool(torch.isfinite(q).all()) for q in pl_module.parameters()),
            }
            (out / f"result.rank{rank}.json").write_text(json.dumps(result))

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    ddpmon_cb = DdpmonCallback(on_nonfinite="rerun", **agent_options(a.port, out))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=a.steps,
        callbacks=[ddpmon_cb, Recorder()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), loader)


if __name__ == "__main__":
    main()
