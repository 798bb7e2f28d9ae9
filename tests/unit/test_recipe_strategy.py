"""docs/architecture.md's strategy recipe, held: a strategy ddpmon does not ship is its gradient
source (how it measures, what marks its steps, what it adds to the manifest) and one registered
row. ``attach`` then measures a model of its kind through it: no module of ``ddpmon/agent`` is
edited for it, and none names it (tests/unit/test_layering.py holds that for the strategies
ddpmon ships)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.probes.grads import full_pass
from ddpmon.strategies import registry
from ddpmon.strategies.base import GradientSource, GradSummaries, StepHost
from ddpmon.strategies.registry import Strategy


class ToyReplicated(nn.Module):
    """A made-up wrapper whose ranks hold full, replicated gradients (here: one rank)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class ForwardCount:
    """The strategy's own step marker (a real one wraps a schedule's or an engine's ``step``):
    here it counts the wrapper's forwards, and comes off with ``close()``."""

    def __init__(self, host: StepHost) -> None:
        self.forwards = 0
        self.closed = False
        self._handle = host.model.register_forward_pre_hook(self._seen)

    def _seen(self, module: nn.Module, args: tuple) -> None:
        self.forwards += 1

    def close(self) -> None:
        self._handle.remove()
        self.closed = True


class ToySource(GradientSource):
    """Step 1 of the recipe: the source. Its gradients are full and replicated, so the norms
    after backward are the reduced ones."""

    name = "toy"
    made: list[ToySource] = []

    def __init__(self, env) -> None:
        super().__init__(env)
        self.marker: ForwardCount | None = None
        ToySource.made.append(self)

    def markers(self, host: StepHost) -> list[ForwardCount]:
        self.marker = ForwardCount(host)
        return [self.marker]

    def collect(self) -> GradSummaries:
        norms = full_pass(self.index, scaled=self.env.grads_scaled_now())
        return GradSummaries(reduced=norms, local_is_reduced=True)

    def manifest_extra(self) -> dict:
        return {"toy": {"replicas": 1}}


@pytest.fixture
def registered():
    """Step 2 of the recipe: the row, with the test that claims a model for it."""
    ToySource.made.clear()
    before = registry.register(
        Strategy("toy", ToySource, claims=lambda m: isinstance(m, ToyReplicated))
    )
    try:
        yield
    finally:
        registry.unregister("toy", before)


def test_attach_measures_a_registered_strategy_through_its_source(registered, tmp_path):
    torch.manual_seed(0)
    model = ToyReplicated(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
    assert mon.enabled, mon.error
    expected = []
    try:
        assert mon.strategy == "toy"
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            expected.append(float(total))
            opt.step()
        records = mon.recent_steps()
        (source,) = ToySource.made
        assert source.marker is not None and source.marker.forwards == 3
    finally:
        mon.close()
    assert source.marker.closed  # the strategy's markers come off with the monitor
    assert [r.grad_norm for r in records] == pytest.approx(expected, rel=1e-6)
    manifest = json.loads((Path(mon.run_path) / "manifest.json").read_text())
    assert manifest["extra"]["strategy"] == "toy"
    assert manifest["extra"]["toy"] == {"replicas": 1}


def test_without_its_row_the_same_model_is_plain(tmp_path):
    model = ToyReplicated(nn.Linear(4, 2))
    assert registry.detect_strategy(model) == "plain"
    assert "toy" not in registry.STRATEGIES
