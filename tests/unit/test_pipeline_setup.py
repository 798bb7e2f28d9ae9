"""``attach(..., schedule=)`` refusals that need no process group: each gives a disabled
monitor whose error is the documented message, and training goes on."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import ddpmon
from ddpmon.strategies.pipeline.setup import SCALER_REFUSED


def _schedule(*modules: torch.nn.Module) -> SimpleNamespace:
    stages = [
        SimpleNamespace(
            submod=m, stage_index=i, num_stages=len(modules), is_first=i == 0,
            is_last=i == len(modules) - 1, group=None,
        )
        for i, m in enumerate(modules)
    ]
    return SimpleNamespace(_stages=stages, step=lambda *a, **k: None, _n_microbatches=4)


def test_gradscaler_is_refused_with_the_documented_message():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mon = ddpmon.attach(model, opt, scaler, schedule=_schedule(model), port=0)
    assert not mon.enabled
    assert mon.error == SCALER_REFUSED
    assert "Attempted step but _scale is None" in mon.error


def test_a_part_outside_the_schedule_is_named():
    inside, outside = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(outside.parameters(), lr=0.1)
    mon = ddpmon.attach(outside, opt, schedule=_schedule(inside), port=0)
    assert not mon.enabled
    assert "model_parts[0] (Linear) is not the module of any PipelineStage" in mon.error


def test_a_stage_of_this_rank_missing_from_model_parts_is_named():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    mon = ddpmon.attach([a], opt, schedule=_schedule(a, b), port=0)
    assert not mon.enabled
    assert "runs stage(s) [1] on this rank but model_parts does not hold them" in mon.error


def test_something_that_is_no_schedule_is_refused():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, schedule=object(), port=0)
    assert not mon.enabled
    assert "object holds no PipelineStage" in mon.error


def test_a_second_attach_to_the_same_schedule_is_refused(tmp_path):
    """The first monitor wraps schedule.step on the instance; a second would be undone by the
    first's close. (No step is taken: nothing collective runs.)"""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = _schedule(model)
    own_step = schedule.step
    first = ddpmon.attach(model, opt, schedule=schedule, port=0, run_dir=str(tmp_path))
    try:
        assert first.enabled, first.error
        assert first.state.strategy == "pp"
        second = ddpmon.attach(model, opt, schedule=schedule, port=0, run_dir=str(tmp_path))
        assert not second.enabled
        assert second.error == (
            "ddpmon is already attached to this schedule; close the first monitor before "
            "attaching again"
        )
    finally:
        first.close()
    assert schedule.step is own_step  # the instance's own step is back
