"""docs/architecture.md's recipes, held: a per-step metric is its declaration plus its
computation, and a sink is a class with the sink protocol. Each test follows its recipe with a
made-up part and touches no agent module (the strategy recipe: test_agent_parts.py; the alert
recipe: tests/alerts/test_alert_recipe.py)."""

import logging

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.agent.guard import Guard
from ddpmon.agent.policy import NonFinitePolicy
from ddpmon.agent.step_flow import StepFlow
from ddpmon.config import ConfigError
from ddpmon.metrics import Layer, Metric, MetricType, step_metrics
from ddpmon.metrics.step_metrics import StepMetric
from ddpmon.probes.grads import NormVector, ParamIndex
from ddpmon.strategies.base import GradientSource, GradSummaries
from tests.support.ports import free_port
from tests.support.scrape import scrape

# -- a per-step metric: one declaration and one computation ---------------------------------
WEIGHT_MAX = Metric("ddpmon_test_weight_abs_max", MetricType.GAUGE,
                    "Largest absolute weight after the step.", Layer.NUMERICS)
TOKENS = Metric("ddpmon_test_tokens_total", MetricType.COUNTER, "Tokens trained on.",
                Layer.DATA_SUPPLY)


def weight_abs_max(inputs):  # a device value: stays a tensor, read back with the step's others
    return torch.stack([p.detach().abs().max() for p in MODEL_PARAMS])


def tokens(inputs):  # a host value
    return 5.0


def broken(inputs):
    raise RuntimeError("a computation that fails")


MODEL_PARAMS: list[torch.Tensor] = []


@pytest.fixture
def declared():
    """The recipe's two steps, for three made-up metrics: objects passed to ``attach`` beside
    a built-in's name (the built-in ones sit in ``step_metrics.AVAILABLE`` the same way)."""
    return [
        StepMetric("weight_abs_max", WEIGHT_MAX, lambda i: weight_abs_max(i).max()),
        StepMetric("tokens", TOKENS, tokens),
        StepMetric("broken", Metric("ddpmon_test_broken", MetricType.GAUGE, "Never set.",
                                    Layer.NUMERICS), broken),
    ]


def test_a_per_step_metric_is_its_declaration_and_its_computation(declared, tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    MODEL_PARAMS[:] = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with caplog.at_level(logging.ERROR, logger="ddpmon"):
        mon = ddpmon.attach(model, opt, port=free_port(), bind="127.0.0.1",
                            run_dir=str(tmp_path),
                            step_metrics=["learning_rate", *declared])
    try:
        lrs = []
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            sched.step()
        mon.flush()
        exposed = scrape(mon.port)
        largest = max(p.detach().abs().max().item() for p in model.parameters())
    finally:
        mon.close()
    assert lrs == [0.1, 0.05, 0.025]
    assert exposed[("ddpmon_learning_rate", ())] == 0.025  # the rate the last step used
    assert exposed[("ddpmon_test_weight_abs_max", ())] == pytest.approx(largest, rel=1e-6)
    assert exposed[("ddpmon_test_tokens_total", ())] == 15.0  # a counter adds its values
    # a computation that raises is counted under the step probe; training went on
    assert not any(name == "ddpmon_test_broken" for name, _ in exposed)
    assert exposed[("ddpmon_agent_errors_total", (("probe", "step"),))] == 3
    assert mon.state.steps_total == 3


def test_per_step_metrics_are_opt_in_and_named_precisely(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
    try:
        model(torch.randn(3, 2)).sum().backward()
        opt.step()
        mon.flush()
        assert mon.flow.step_metrics == () and mon.state.step_values == {}
    finally:
        mon.close()
    with pytest.raises(ConfigError, match=r"unknown 'lr'; known: learning_rate"):
        ddpmon.Config(step_metrics=["lr"])
    with pytest.raises(ConfigError, match="expected a list of names"):
        ddpmon.Config(step_metrics="learning_rate")
    parsed = ddpmon.Config.from_sources(environ={"DDPMON_STEP_METRICS": "learning_rate, "})
    assert parsed.step_metrics == ("learning_rate",)
    with pytest.raises(ValueError, match="unlabelled gauge or counter"):
        StepMetric("h", Metric("ddpmon_test_h", MetricType.HISTOGRAM, "h", Layer.NUMERICS),
                   tokens)


def test_a_device_lr_stays_on_the_device_and_a_cpu_tensor_lr_is_a_host_value():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=torch.tensor(0.5))
    inputs = step_metrics.StepInputs(0, opt, None, None)
    assert step_metrics.learning_rate(inputs) == 0.5
    assert isinstance(step_metrics.learning_rate(inputs), float)
    assert step_metrics.learning_rate(step_metrics.StepInputs(0, object(), None, None)) is None


# -- a sink: a class with the sink protocol --------------------------------------------------
class OneNorm(GradientSource):
    name = "scripted"

    def __init__(self):  # no strategy environment: nothing to reduce
        pass

    def collect(self):
        return GradSummaries(reduced=NormVector(torch.tensor([3.0, 4.0], dtype=torch.float64),
                                                [0, 1]), local_is_reduced=True)


class Recording:
    """The recipe's sink: ``probe``, ``on_record``, ``on_batch_end``, ``close``."""

    probe = "history"

    def __init__(self, fail_at=None):
        self.steps, self.batches, self.fail_at = [], 0, fail_at

    def on_record(self, record):
        if record.step == self.fail_at:
            raise OSError("disk full")
        self.steps.append((record.step, record.grad_norm))

    def on_batch_end(self):
        self.batches += 1

    def close(self):
        pass


def test_a_sink_gets_every_record_in_order_and_its_failure_is_counted_under_its_probe():
    model = nn.Sequential(nn.Linear(2, 2))  # weight and bias
    index = ParamIndex(model)
    errors = []
    failing, healthy = Recording(fail_at=1), Recording()
    pipe = StepFlow(
        source=OneNorm(), index=index, guard=Guard(errors.append),
        policy=NonFinitePolicy("record", index, 0, lambda *a, **k: None),
        sinks=[failing, healthy],
    )
    pipe.background = True  # steps queue; one drain delivers them as one batch
    for _ in range(3):
        pipe.forward_started(())
        pipe.backward_ended()
        pipe.optimizer_pre((None,), {})
        pipe.optimizer_post()
    pipe.drain(wait=True)
    assert healthy.steps == [(0, 5.0), (1, 5.0), (2, 5.0)]
    assert failing.steps == [(0, 5.0), (2, 5.0)]  # its step-1 failure cost it that record only
    assert errors == ["history"] and healthy.batches == failing.batches == 1
