"""One rank of a 2-rank Transformers ``Trainer`` run with ``DdpmonCallback(on_nonfinite="rerun")``
and nothing else changed: the Trainer steps without a closure; the callback records each step's
``training_step`` calls so ddpmon can rerun them.

A tiny GPT-2 with dropout, gradient accumulation over 2 micro-batches. Rank ``--transient-rank``
gets a NaN in one local gradient in the first micro-batch of step ``--transient-step``, first
run only (a transient fault); rank ``--deterministic-rank`` gets one in every backward of step
``--deterministic-step`` (a batch that always overflows). Writes ``OUT/result.rank<R>.json``:
the backward passes per step, the error the Trainer raised, the rerun events and whether the
weights stayed finite."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ddpmon.integrations.transformers import DdpmonCallback
from tests.integrations.transformers_worker import NAN_PARAM, Tokens
from tests.support.integrations import RUN_ID, agent_options


class Faults(TrainerCallback):
    def __init__(self, model: torch.nn.Module, a: argparse.Namespace) -> None:
        self.step, self.a = -1, a
        self.backwards: dict[int, int] = {}
        self.rank = int(os.environ["RANK"])
        dict(model.named_parameters())[NAN_PARAM].register_hook(self._inject)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.step = state.global_step

    def _inject(self, grad: torch.Tensor) -> torch.Tensor:
        seen = self.backwards[self.step] = self.backwards.get(self.step, 0) + 1
        a = self.a
        if self.rank == a.transient_rank and self.step == a.transient_step and seen == 1:
            return grad * float("nan")
        if self.rank == a.deterministic_rank and self.step == a.deterministic_step:
            return grad * float("nan")
        return grad


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--transient-step", type=int, default=2)
    p.add_argument("--transient-rank", type=int, default=1)
    p.add_argument("--deterministic-step", type=int, default=4)
    p.add_argument("--deterministic-rank", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    faults = Faults(model, a)
    ddpmon_cb = DdpmonCallback(on_nonfinite="rerun", **agent_options(a.port, out))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256, 16, config.vocab_size),
                      callbacks=[faults, ddpmon_cb])
    error = None
    try:
        trainer.train()
    except Exception as exc:  # the deterministic fault: ddpmon's error, out of trainer.train()
        error = {"type": type(exc).__name__, "message": str(exc)}
    if ddpmon_cb.monitor is not None:
        ddpmon_cb.monitor.close()
    rank = faults.rank
    events = out / "runs" / RUN_ID / f"events.rank{rank}.jsonl"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    result = {
        "rank": rank,
        "global_step": trainer.state.global_step,
        "backwards": faults.backwards,
        "error": error,
        "reruns": [e for e in lines if e["kind"] == "rerun"],
        "finite": all(bool(torch.isfinite(q).all()) for q in model.parameters()),
    }
    (out / f"result.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
