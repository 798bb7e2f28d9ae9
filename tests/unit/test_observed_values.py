"""Observed values of any tensor type, on a world of 1 (gloo, one process, a CPU DeviceMesh):
a DTensor loss or trainer norm (Replicate; Partial or Shard on a one-rank mesh dim) is recorded
as its full value, and a step value that cannot be read back is left out alone and counted, the
rest of the step's record kept. The Partial loss over two ranks is in
tests/parallel/test_observed_values.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ddpmon.agent.observed import plain
from ddpmon.agent.readback import Readback
from ddpmon.agent.step_vector import StepVectorLayout
from ddpmon.metrics import step_slots as slot


@pytest.mark.parametrize("placement", [Replicate(), Partial(), Shard(0)], ids=str)
def test_a_dtensor_is_read_as_its_full_value(mesh, placement):
    value = DTensor.from_local(torch.tensor([2.5]), mesh, [placement])
    got = plain(value)
    assert type(got) is torch.Tensor
    assert got.tolist() == value.full_tensor().tolist() == [2.5]


def test_one_unreadable_slot_is_left_out_alone(mesh):
    seen: list[tuple[str, str]] = []
    readback = Readback(StepVectorLayout())
    readback.on_unreadable = lambda name, exc: seen.append((name, str(exc)))
    loss = DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()])  # not made plain: raw
    readback.push({slot.LOSS: loss, slot.REDUCED_NORMS: torch.tensor([3.0, 4.0])}, meta="m")
    (arrived,) = readback.poll()
    assert arrived.parts() == {slot.REDUCED_NORMS: [3.0, 4.0]}
    assert [name for name, _ in seen] == [slot.LOSS]
    assert "subclass" in seen[0][1]


def test_without_a_listener_an_unreadable_slot_raises(mesh):
    loss = DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()])
    with pytest.raises(RuntimeError, match="subclass"):
        StepVectorLayout().pack({slot.LOSS: loss})


def test_dtensor_losses_and_norms_are_recorded_with_the_step(mesh, tmp_path):
    import ddpmon

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
    assert mon.enabled, mon.error
    placements = [Replicate(), Partial(), Shard(0)]
    expected_loss, expected_norm = [], []
    try:
        for step, placement in enumerate(placements):
            opt.zero_grad()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            mon.observe_loss(DTensor.from_local(loss.detach().reshape(1), mesh, [placement]))
            mon.observe_grad_norm(DTensor.from_local(norm.reshape(1), mesh, [placement]))
            expected_loss.append(float(loss.detach()))
            expected_norm.append(float(norm))
            opt.step()
            assert mon.step == step + 1
        records = mon.recent_steps()
        errors = dict(mon.state.agent_errors)
    finally:
        mon.close()
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.loss for r in records] == pytest.approx(expected_loss, rel=1e-6)
    assert [r.trainer_grad_norm for r in records] == pytest.approx(expected_norm, rel=1e-6)
    assert [r.grad_norm for r in records] == pytest.approx(expected_norm, rel=1e-5)
    assert not any(r.grad_norm_mismatch for r in records)
    assert not any(errors.values()), errors
