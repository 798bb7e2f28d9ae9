"""An empty norm is never silent (ddpmon/agent/unmeasured.py): a step with gradients of which
the source measured nothing counts one ``grads`` error and the first says why; a step whose
measurement failed (already counted) or that has no gradients is not counted."""

from __future__ import annotations

import logging

import torch

from ddpmon.agent.guard import Guard
from ddpmon.agent.unmeasured import UnmeasuredSteps
from ddpmon.probes.grads import NormVector
from ddpmon.strategies.base import GradSummaries


def test_counts_each_unmeasured_step_and_says_once(caplog):
    counted: list[str] = []
    guard = Guard(counted.append)
    param = torch.nn.Parameter(torch.ones(3))
    check = UnmeasuredSteps(guard, [param], "fsdp2+tp")
    check.check(GradSummaries(), 0)  # no gradient yet: nothing to measure
    assert counted == []
    param.grad = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        check.check(GradSummaries(), 1)
        check.check(GradSummaries(), 2)
    assert counted == ["grads", "grads"]
    said = [r for r in caplog.records if "measured none" in r.getMessage()]
    assert len(said) == 1 and "fsdp2+tp" in said[0].getMessage()
    measured = GradSummaries(reduced=NormVector(torch.ones(1), [0]))
    check.check(measured, 3)
    assert counted == ["grads", "grads"]


def test_a_failure_already_counted_is_not_counted_twice():
    counted: list[str] = []
    guard = Guard(counted.append)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    check = UnmeasuredSteps(guard, [param], "plain")
    guard.error("grads", RuntimeError("the pass failed"))
    check.check(GradSummaries(), 0)
    assert counted == ["grads"]
    check.check(GradSummaries(), 1)  # no failure this time: the empty step is counted
    assert counted == ["grads", "grads"]
