"""A 2-rank Lightning DDP run on CPU with DdpmonCallback (launched by Lightning itself).

Run as ``python lightning_worker.py --out DIR --precision 32-true ...``: Lightning's subprocess
launcher re-runs this script for rank 1. The module logs its global gradient norm (Lightning's
``grad_norm`` utility) in ``on_before_optimizer_step``; at ``--wrong-step`` it logs it scaled by
``--factor`` (a deliberately wrong reported norm); with ``--log-every N`` only every N-th step
is logged (the others must not be compared with a stale value). At ``--nan-step`` rank
``--nan-rank`` gets a NaN in one parameter's local gradient, before DDP's all-reduce.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch
from torch import nn

from tests.support.integrations import agent_options, json_number
from tests.support.scrape import scrape_text

NAN_PARAM = "net.0.weight"


CHECKPOINT_EVERY = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--package", default="lightning.pytorch")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--wrong-step", type=int, default=2)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--nan-step", type=int, default=5)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log-every", type=int, default=1, help="log the norm every N steps")
    p.add_argument("--log-key", default="grad_norm", help="name the norm is logged under")
    p.add_argument("--resume", default=None, help="fit(ckpt_path=RESUME): a resumed run")
    a = p.parse_args()
    pl = importlib.import_module(a.package)
    grad_norm = importlib.import_module(f"{a.package}.utilities").grad_norm
    if a.package == "pytorch_lightning":
        from ddpmon.integrations.pytorch_lightning import DdpmonCallback
    else:
        from ddpmon.integrations.lightning import DdpmonCallback
    out = Path(a.out)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            self.true_norms: dict[int, torch.Tensor] = {}
            self.losses: dict[int, torch.Tensor] = {}

        def setup(self, stage: str) -> None:
            param = dict(self.named_parameters())[NAN_PARAM]
            param.register_hook(self._inject)

        def _inject(self, grad: torch.Tensor) -> torch.Tensor:
            step = self.trainer.global_step
            if self.trainer.global_rank == a.nan_rank and step == a.nan_step:
                return grad * float("nan")
            return grad

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses[self.trainer.global_step] = loss.detach().clone()
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            total = grad_norm(self, norm_type=2)["grad_2.0_norm_total"]
            step = self.trainer.global_step
            self.true_norms[step] = total
            reported = total * a.factor if step == a.wrong_step else total
            if step % a.log_every == 0:
                self.log(a.log_key, reported, on_step=True, on_epoch=False)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Recorder(pl.Callback):
        """Reads ddpmon's state after each step and writes the rank's result at the end."""

        def __init__(self, ddpmon_cb) -> None:
            self.cb = ddpmon_cb
            self.norms: dict[int, float | None] = {}
            self.losses: dict[int, float | None] = {}
            self.http_ok = False

        def _sample(self) -> None:
            mon = self.cb.monitor
            if mon is not None and mon.state.step >= 0:
                self.norms[mon.state.step] = mon.state.grad_norm
                self.losses[mon.state.step] = mon.state.loss

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._sample()

        def on_train_end(self, trainer, pl_module) -> None:
            self.http_ok = _scrape(self.cb.monitor)

        def teardown(self, trainer, pl_module, stage) -> None:
            self._sample()  # after DdpmonCallback.teardown closed (and drained) the monitor
            mon = self.cb.monitor
            module = pl_module
            result = {
                "rank": trainer.global_rank,
                "global_step": trainer.global_step,
                "attached": mon is not None and mon.enabled,
                "monitor_error": getattr(mon, "error", "no monitor"),
                "monitor_steps": mon.step if mon is not None else None,
                "observe_grad_norm": hasattr(mon, "observe_grad_norm"),
                "scaler": type(getattr(trainer.precision_plugin, "scaler", None)).__name__,
                "true_norms": {k: json_number(v) for k, v in module.true_norms.items()},
                "trainer_losses": {k: json_number(v) for k, v in module.losses.items()},
                "ddpmon_norms": self.norms,
                "ddpmon_losses": self.losses,
                "http_ok": self.http_ok,
                "exposition": mon.exposition.render().decode() if mon is not None else "",
            }
            path = out / f"result.rank{trainer.global_rank}.json"
            path.write_text(json.dumps(result, default=str))

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    ddpmon_cb = DdpmonCallback(**agent_options(a.port, out))
    precision: dict = {"precision": a.precision}
    if a.precision == "16-mixed":
        # Lightning's connector turns 16-mixed into bf16-mixed on CPU; the plugin keeps fp16
        # autocast with a real GradScaler, which torch supports on CPU.
        mixed = importlib.import_module(f"{a.package}.plugins").MixedPrecision
        precision = {"plugins": [mixed("16-mixed", "cpu")]}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        **precision,
        max_steps=a.steps,
        accumulate_grad_batches=a.accumulate,
        callbacks=[
            ddpmon_cb,
            Recorder(ddpmon_cb),
            # a checkpoint every CHECKPOINT_EVERY steps: ddpmon times the saves
            importlib.import_module(f"{a.package}.callbacks").ModelCheckpoint(
                dirpath=str(out / "ckpt"), every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1
            ),
        ],
        logger=False,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), loader, ckpt_path=a.resume)


def _scrape(mon) -> bool | str:
    """True if the rank's /metrics answered; else why not (for the assertion message)."""
    if mon is None or not mon.port:
        return f"no endpoint (port {getattr(mon, 'port', None)})"
    try:
        scrape_text(mon.port)
        return True
    except OSError as exc:
        return f"port {mon.port}: {exc}"



if __name__ == "__main__":
    main()
