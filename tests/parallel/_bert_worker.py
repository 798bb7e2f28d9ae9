"""One rank of the BERT norm check, set up as DeepSpeedExamples' HelloDeepSpeed
``train_bert_ds.py`` sets up its run: a RoBERTa-style masked LM built from a config (tied input
and output embeddings, a 50,265-token vocabulary), DeepSpeed ZeRO-1, bf16, Adam with the
optimizer offloaded to the CPU, ``engine.backward``/``engine.step``. Batches are random tokens,
15% of them masked (the script tokenises wikitext; nothing here can download it). Per step the
rank records ddpmon's global norm, DeepSpeed's own (``get_global_grad_norm``) and an fp64 norm of
DeepSpeed's full gradients (``safe_get_full_grad``). Assertions: test_norm_precision.py.

Run as: ``python _bert_worker.py --out DIR --hidden H`` with the rank env set, 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: E402

import ddpmon  # noqa: E402

# 16 tokens a step, far fewer than the script's batches: the float32 drift grows with the
# parameters, which are the script's (the tied output layer's gradient is dense over the whole
# vocabulary whatever the tokens), while each token costs bf16 matmuls against that vocabulary,
# slow on a CPU without bf16 units: an AVX2-only EPYC took 144 s for 4 steps of 8 x 64 tokens at
# the script's width, and 27 s a backward at 768 wide with 4 x 16.
VOCAB, SEQ, BATCH, STEPS = 50265, 8, 2, 4


class MaskedLM(torch.nn.Module):
    """The model returns its loss, as the script's wrapper does."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        config = RobertaConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=6, num_attention_heads=8,
            intermediate_size=2 * hidden, max_position_embeddings=SEQ + 2,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = RobertaForMaskedLM(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    masked = torch.rand(BATCH, SEQ, generator=gen) < 0.15
    masked[:, 1] = True  # every row predicts a token: a loss over no label would be NaN
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(masked, torch.full_like(ids, 4), ids), "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(42)
    model = MaskedLM(args.hidden)
    conf = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=conf
    )
    mon = ddpmon.attach(
        engine, port=0, run_dir=str(Path(args.out) / "runs"), run_id="bert", announce=False
    )
    assert mon.enabled, mon.error
    named = list(engine.module.named_parameters())
    fp64, deepspeeds = [], []
    for step in range(STEPS):
        loss = engine(**batch(step, rank))
        engine.backward(loss)
        squares = 0.0
        for _, param in named:
            grad = safe_get_full_grad(param)
            if grad is not None:
                squares += float(grad.double().square().sum())
        fp64.append(math.sqrt(squares))
        engine.step()
        deepspeeds.append(float(engine.get_global_grad_norm()))
    mon.flush()
    ours = [r.grad_norm for r in mon.recent_steps()]
    parameters = sum(p.numel() for _, p in named)
    mon.close()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "ours": ours, "deepspeed": deepspeeds, "fp64": fp64,
        "parameters": parameters, "tied": engine.module.model.lm_head.decoder.weight
        is engine.module.model.roberta.embeddings.word_embeddings.weight,
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
