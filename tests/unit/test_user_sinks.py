"""``attach(..., sinks=[...])``: a sink of the caller's, typed by ``ddpmon.agent.sinks.Sink``,
gets every step record beside ddpmon's own; one that raises is counted, never raised into the
loop; an object that is no sink turns the agent off with the reason, as a bad option does."""

from __future__ import annotations

import torch
from torch import nn

import ddpmon
from ddpmon.agent.sinks import Sink
from ddpmon.metrics.state import StepRecord
from tests.support.ports import free_port
from tests.support.scrape import scrape


class Recorder:
    probe = "recorder"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.norms: list[float | None] = []
        self.closed = False

    def on_record(self, record: StepRecord) -> None:
        self.steps.append(record.step)
        self.norms.append(record.grad_norm)

    def close(self) -> None:
        self.closed = True


class Broken(Recorder):
    probe = "broken_sink"

    def on_record(self, record: StepRecord) -> None:
        raise RuntimeError("a user's sink failed")


def _train(steps: int, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, bind="127.0.0.1", **options)
    norms = []
    try:
        for _ in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            opt.step()
            opt.zero_grad()
        metrics = scrape(mon.port) if mon.enabled else {}
    finally:
        mon.close()
    return mon, norms, metrics


def test_a_users_sink_gets_every_record_and_is_closed(tmp_path):
    mine = Recorder()
    assert isinstance(mine, Sink)
    mon, norms, _ = _train(4, sinks=[mine], port=free_port(), run_dir=str(tmp_path))
    assert mon.enabled and mine.closed
    assert mine.steps == [0, 1, 2, 3]
    for ours, torchs in zip(mine.norms, norms, strict=True):
        assert abs(float(ours) - torchs) <= 1e-5 * max(1.0, torchs)


def test_a_failing_sink_is_counted_and_training_goes_on(tmp_path):
    broken, after = Broken(), Recorder()
    mon, _, metrics = _train(3, sinks=[broken, after], port=free_port(), run_dir=str(tmp_path))
    assert after.steps == [0, 1, 2]  # the next sink still ran
    assert metrics[("ddpmon_agent_errors_total", (("probe", "broken_sink"),))] >= 1


def test_an_object_that_is_no_sink_turns_the_agent_off():
    mon, _, _ = _train(1, sinks=[object()], port=free_port())
    assert not mon.enabled
    assert "object" in mon.error and "on_record" in mon.error
