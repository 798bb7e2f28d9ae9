"""The update probe's limits: a weight copy over its byte budget is never made, and the vector's
length comes from the optimizer, not from which state a rank holds (sharded ranks must agree)."""

from __future__ import annotations

import logging

import torch

from ddpmon.probes.grads import ParamIndex
from ddpmon.probes.updates import UpdateProbe


def _probe(optimizer_class, budget: int, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = optimizer_class(model.parameters(), lr=1e-2)
    errors: list = []
    probe = UpdateProbe(opt, ParamIndex(model), 1, lambda: 0,
                        lambda name, exc: errors.append((name, exc)), copy_budget=budget, **kwargs)
    return model, opt, probe, errors


def _step(model, opt) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_copy_over_the_budget_is_skipped_counted_and_logged_once(caplog):
    model, opt, probe, errors = _probe(torch.optim.AdamW, budget=64)
    assert probe.copy_bytes == sum(p.numel() * 4 for p in model.parameters())
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        for _ in range(3):
            _step(model, opt)
            assert probe.take() is None
    assert probe.skipped == 3 and not errors
    told = [r for r in caplog.records if "update_copy_budget_mib" in r.getMessage()]
    assert len(told) == 1


def test_within_the_budget_the_step_is_measured():
    model, opt, probe, errors = _probe(torch.optim.AdamW, budget=1 << 20)
    _step(model, opt)
    vector = probe.take()
    assert vector is not None and probe.skipped == 0 and not errors
    assert vector.numel() == 4 * len(probe.index.params)


def test_an_adam_rank_without_moments_still_sends_four_values_per_parameter():
    """A rank of a sharded plan whose pieces have no optimizer state: its vector must be as
    long as its peers' (4n), zeros for the moments, or the all-reduce sizes differ."""
    model, opt, probe, errors = _probe(torch.optim.Adam, budget=1 << 20)
    _step(model, opt)
    probe.take()
    opt.state.clear()  # this rank holds no state for its pieces
    probe._pre(opt, (), {})
    probe._post(opt, (), {})
    vector = probe.take()
    n = len(probe.index.params)
    assert vector is not None and not errors
    assert vector.numel() == 4 * n
    assert torch.count_nonzero(vector[2 * n:]) == 0


def test_sgd_sends_two_values_per_parameter():
    model, opt, probe, errors = _probe(torch.optim.SGD, budget=1 << 20)
    _step(model, opt)
    vector = probe.take()
    assert vector is not None and vector.numel() == 2 * len(probe.index.params)
