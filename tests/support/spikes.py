"""A tiny classifier trained the way a loop does, for the spike tests (tests/unit/test_spikes.py):
three module groups (``inp``, ``mid``, ``out``), one AdamW parameter group each, so one group's
learning rate can be raised for one step; labels with 30% noise keep the loss off zero, where
its batch-to-batch noise is small relative to its level (as in a language model's)."""

from __future__ import annotations

import torch
from torch import nn

GROUPS = ("inp", "mid", "out")


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def train(mon, model, opt, steps: int, spike_at: int | None = None, group: int = 1,
          factor: float = 300.0, seed: int = 3) -> None:
    """``steps`` steps; at ``spike_at`` the ``group``-th parameter group's lr is ``factor``
    times higher for that one step."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(8, 4, generator=gen)
    for step in range(steps):
        x = torch.randn(64, 8, generator=gen)
        labels = (x @ teacher).argmax(1)
        noisy = torch.rand(64, generator=gen) < 0.3
        labels = torch.where(noisy, torch.randint(0, 4, (64,), generator=gen), labels)
        loss = nn.functional.cross_entropy(model(x), labels)
        mon.observe_loss(loss)
        mon.observe_samples(torch.arange(step * 64, step * 64 + 64))
        loss.backward()
        lr = opt.param_groups[group]["lr"]
        if step == spike_at:
            opt.param_groups[group]["lr"] = lr * factor
        opt.step()
        opt.param_groups[group]["lr"] = lr
        opt.zero_grad()


def model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyClassifier()
    opt = torch.optim.AdamW(
        [{"params": getattr(model, g).parameters()} for g in GROUPS], lr=3e-3
    )
    return model, opt
