"""A tiny transformer and the single-device reference for the per-group update figures
(``probes.updates``): computed from full weights and optimizer state, before and after a step,
in float64, by hooks registered after ddpmon's (tests/unit/test_updates.py,
tests/parallel/_updates_worker.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, WIDTH, SEQ = 32, 16, 8


class TinyTransformer(nn.Module):
    """Embedding, one encoder block, an output head: three groups at ``group_depth=1``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(tokens)))


def batch(generator: torch.Generator, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    return tokens, torch.roll(tokens, 1, dims=1)


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().to(torch.float64).clone()


def _group(name: str) -> str:
    return name.split(".")[0]


class Reference:
    """Per-group figures of every step, from full tensors (``.full_tensor()`` for DTensor)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.steps: list[dict[str, dict[str, float]]] = []
        self._before: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_):
        self._before = [_full(p) for _, p in self.named]

    def _post(self, *_):
        sums: dict[str, dict[str, float]] = {}
        for (name, p), before in zip(self.named, self._before, strict=True):
            after = _full(p)
            state = self.optimizer.state.get(p, {})
            parts = {"weight_norm": after, "update_norm": after - before}
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    parts[f"{key}_norm"] = _full(state[key])
            add_squares(sums, _group(name), parts)
        self.steps.append(figures_of(sums))


def add_squares(sums: dict[str, dict[str, float]], group: str,
                parts: dict[str, torch.Tensor]) -> None:
    """Add each part's sum of squares to ``sums[group]`` (float64 on the host)."""
    into = sums.setdefault(group, {})
    for key, t in parts.items():
        into[key] = into.get(key, 0.0) + float((t * t).sum())


def figures_of(sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per group: the norms (square roots of the sums) and the update ratio."""
    out = {}
    for group, squares in sums.items():
        figures = {k: math.sqrt(v) for k, v in squares.items()}
        figures["update_ratio"] = figures["update_norm"] / figures["weight_norm"]
        out[group] = figures
    return out


def relative_errors(measured: dict, reference: dict) -> list[tuple[str, str, float]]:
    """(group, field, relative error) of every reference figure."""
    errors = []
    for group, figures in reference.items():
        for key, want in figures.items():
            got = measured[group][key]
            errors.append((group, key, abs(got - want) / max(abs(want), 1e-30)))
    return errors


class Records:
    """A record sink that keeps the sampled steps' figures (a test's window on the records)."""

    probe = "history"

    def __init__(self) -> None:
        self.update_stats: dict[int, dict] = {}
        self.logit_max: dict[int, dict] = {}

    def on_record(self, record) -> None:
        if record.update_stats:
            self.update_stats[record.step] = record.update_stats
        if record.logit_max:
            self.logit_max[record.step] = record.logit_max

    def close(self) -> None:
        pass
