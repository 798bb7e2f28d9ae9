"""One rank of a 2-rank Transformers ``Trainer`` run under torchrun (gloo, CPU) with ddpmon.

A tiny GPT-2 built from a config (no downloads), synthetic tokens, gradient accumulation over
``--accumulate`` micro-batches, the Trainer logging its grad norm every step. At ``--wrong-step``
(ddpmon's 0-based step index) the reported norm is scaled by ``--factor``; at ``--nan-step``
rank ``--nan-rank`` gets a NaN in one parameter's local gradient before DDP's all-reduce.
``--deepspeed-stage N``: the Trainer runs DeepSpeed ZeRO-N from a config with "auto" values.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ddpmon.integrations.transformers import DdpmonCallback
from tests.support.hf_hooks import ScaleReportedGradNorm
from tests.support.integrations import agent_options, json_number
from tests.support.scrape import scrape_text

NAN_PARAM = "transformer.h.0.mlp.c_fc.weight"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class NanInjector(TrainerCallback):
    """Tracks the global step so the gradient hook can fire at one step on one rank."""

    def __init__(self, model: torch.nn.Module, step: int, rank: int) -> None:
        self.current = -1
        if int(os.environ.get("RANK", "0")) == rank:
            param = dict(model.named_parameters())[NAN_PARAM]
            param.register_hook(lambda g: g * float("nan") if self.current == step else g)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.current = state.global_step


class Recorder(TrainerCallback):
    """ddpmon's state after each optimizer step; the rank's result once ddpmon has closed."""

    def __init__(self, ddpmon_cb: DdpmonCallback, out: Path, steps: int) -> None:
        self.cb, self.out, self.steps = ddpmon_cb, out, steps
        self.norms: dict[int, float | None] = {}
        self.losses: dict[int, float | None] = {}
        self.http_ok = False

    def _sample(self) -> None:
        mon = self.cb.monitor
        if mon is not None and mon.state.step >= 0:
            self.norms[mon.state.step] = mon.state.grad_norm
            self.losses[mon.state.step] = mon.state.loss

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._sample()
        if state.global_step == self.steps:
            self.http_ok = _scrape(self.cb.monitor)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._sample()  # DdpmonCallback.on_train_end (earlier in the list) closed the monitor
        mon = self.cb.monitor
        logged = {
            entry["step"] - 1: entry["grad_norm"]
            for entry in state.log_history
            if "grad_norm" in entry
        }
        logged_losses = {
            entry["step"] - 1: entry["loss"] for entry in state.log_history if "loss" in entry
        }
        rank = int(os.environ.get("RANK", "0"))
        result = {
            "rank": rank,
            "global_step": state.global_step,
            "attached": mon is not None and mon.enabled,
            "monitor_error": getattr(mon, "error", "no monitor"),
            "monitor_steps": mon.step if mon is not None else None,
            "observe_grad_norm": hasattr(mon, "observe_grad_norm"),
            "scaler": type(getattr(mon, "scaler", None)).__name__,
            "strategy": mon.state.strategy if mon is not None and mon.enabled else None,
            "true_norms": {k: json_number(v) for k, v in logged.items()},
            "ddpmon_norms": {k: json_number(v) for k, v in self.norms.items()},
            "trainer_losses": {k: json_number(v) for k, v in logged_losses.items()},
            "ddpmon_losses": {k: json_number(v) for k, v in self.losses.items()},
            "http_ok": self.http_ok,
            "exposition": mon.exposition.render().decode() if mon is not None else "",
        }
        (self.out / f"result.rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--wrong-step", type=int, default=2)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--nan-step", type=int, default=5)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--deepspeed-stage", type=int, default=None)
    p.add_argument("--hf-dir", default=None, help="the Trainer's output_dir (default OUT/hf)")
    p.add_argument("--full-checkpoints", action="store_true", help="checkpoints a resume can use")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    a = p.parse_args()
    out = Path(a.out)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=32,
        vocab_size=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.hf_dir or str(out / "hf"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=a.accumulate,
        max_steps=a.steps,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",  # checkpoint-2, -4, -6: ddpmon times each save
        save_steps=2,
        save_only_model=not a.full_checkpoints,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        fp16=a.fp16,
        seed=0,
        deepspeed=ds_config(a.deepspeed_stage) if a.deepspeed_stage is not None else None,
    )
    ddpmon_cb = DdpmonCallback(**agent_options(a.port, out))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(256, 16, config.vocab_size),
        callbacks=[
            NanInjector(model, a.nan_step, a.nan_rank),
            ScaleReportedGradNorm(a.wrong_step + 1, a.factor),  # global_step = index + 1
            ddpmon_cb,
            Recorder(ddpmon_cb, out, a.steps),
        ],
    )
    trainer.train(resume_from_checkpoint=True if a.resume else None)


def ds_config(stage: int) -> dict:
    """A DeepSpeed config as users write one for the Trainer: "auto" filled from the args."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


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
