"""attach given a wrapper around the strategy's module (strategies/wrappers.py): Lightning
Fabric's wrappers are looked through, any other wrapper holding DDP is never silent."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpmon
from ddpmon.strategies.registry import detect_strategy
from ddpmon.strategies.wrappers import MISSING_WITHOUT_DDP, unwrap


@pytest.fixture(scope="module", autouse=True)
def group():
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_model() -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def one_step(mon, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    mon.close()


def test_a_custom_wrapper_around_ddp_is_monitored_as_ddp_with_one_warning(tmp_path, caplog):
    class Wrapper(nn.Module):  # e.g. a research loop's EMA or logging wrapper
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        for attempt in range(2):  # a DDP module takes one comm hook: a new one each time
            wrapped = Wrapper(ddp_model())
            opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
            mon = ddpmon.attach(wrapped, opt, port=0, run_dir=str(tmp_path / str(attempt)))
            assert mon.enabled, mon.error
            assert mon.strategy == "ddp"
            one_step(mon, wrapped, opt)
            assert mon.state.collective_count() > 0  # the comm hook on the DDP inside ran
    (warning,) = warnings_about(caplog, "attach got a")  # once per wrapper type
    assert f"{Wrapper.__module__}.{Wrapper.__qualname__}" in warning
    assert "monitoring the DDP module inside it" in warning


def test_a_wrapper_with_parameters_outside_ddp_says_what_is_missing(tmp_path, caplog):
    class WithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = ddp_model(), nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    model = WithHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
        one_step(mon, model, opt)
    assert mon.strategy == "plain"
    (warning,) = warnings_about(caplog, "attach got a")
    assert WithHead.__qualname__ in warning and MISSING_WITHOUT_DDP in warning


def test_a_plain_model_is_not_warned_about(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
        one_step(mon, model, opt)
    assert mon.strategy == "plain" and warnings_about(caplog, "attach got a") == []


def test_fabrics_wrappers_give_the_strategys_module_and_the_real_optimizer():
    wrappers = pytest.importorskip("lightning.fabric.wrappers")
    ddp = ddp_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # as fabric.setup builds them (the strategy is only used by forward and step)
    fabric_model = wrappers._FabricModule(ddp, strategy=None, original_module=ddp.module)
    fabric_opt = wrappers._FabricOptimizer(opt, strategy=None)
    assert isinstance(fabric_opt, torch.optim.SGD)  # Fabric imitates the optimizer's class
    assert detect_strategy(fabric_model) == "plain"  # what attach saw before unwrapping
    model, optimizer = unwrap(fabric_model, fabric_opt)
    assert model is ddp and optimizer is opt
    assert unwrap(ddp, opt) == (ddp, opt)  # the bare strategy is left as it is


def test_fsdp2_inside_an_unknown_wrapper_is_detected():
    from torch.distributed.fsdp import fully_shard

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    sharded = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    assert detect_strategy(Holder(sharded)) == "fsdp2"
