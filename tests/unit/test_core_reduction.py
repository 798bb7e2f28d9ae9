"""The norm reduction, at world size 1 in this process: the one protocol (``FlaggedSum``),
``build_plan``, ``ShardedNorms`` and ``DeferredReduction``, each checked against torch's own
numbers (``clip_grad_norm_`` over ``full_tensor()``), without a subprocess rank.

A one-rank gloo group is a real process group: DTensors over its mesh have real placements, the
all-reduce returns a real ``Work``, and the failure slot travels through a real collective.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ddpmon.probes.grads import ParamIndex
from ddpmon.strategies import dtensor_norms
from ddpmon.strategies.base import DeferredReduction
from ddpmon.strategies.dtensor_norms import DisjointSpan, ShardedNorms, build_plan
from ddpmon.strategies.reduction import FlaggedSum, failed_vector


class Sharded(torch.nn.Module):
    """Two sharded weights, one replicated bias and one plain tensor with its own norm."""

    def __init__(self, mesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        self.w2 = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(1)]))
        self.b = torch.nn.Parameter(distribute_tensor(torch.randn(3), mesh, [Replicate()]))

    def grads(self, scale: float = 1.0) -> None:
        for p in self.parameters():
            p.grad = distribute_tensor(
                torch.randn(p.shape) * scale, p.device_mesh, list(p.placements)
            )


def torch_norm(model: torch.nn.Module) -> float:
    """What the user's own tool reports: clip_grad_norm_ over the full gradients."""
    full = [p.grad.full_tensor() for p in model.parameters()]
    return float(torch.nn.utils.get_total_norm(full))


# ---------------------------------------------------------------------------- build_plan
def test_plain_tensors_need_no_reduction():
    params = [torch.zeros(3), torch.zeros(2, 2)]
    plan = build_plan(params)
    assert plan.groups == []  # nothing to reduce over
    assert plan.mask.tolist() == [1.0, 1.0]
    assert plan.width == 2


def test_sharded_parameters_reduce_over_their_mesh_group(mesh):
    model = Sharded(mesh)
    plan = build_plan(list(model.parameters()))
    assert len(plan.groups) == 1  # one mesh dim, named once for both sharded weights
    assert plan.mask.dtype == torch.float64
    assert plan.mask.tolist() == [1.0, 1.0, 1.0]  # rank 0 of the group counts the replica


def test_a_disjoint_span_puts_this_ranks_block_at_its_offset(mesh):
    model = Sharded(mesh)
    span = DisjointSpan(dist.group.WORLD, offset=5, total=9)
    plan = build_plan(list(model.parameters()), span)
    assert plan.groups[-1] is dist.group.WORLD  # the span's group is summed last
    assert plan.width == 9
    vector = torch.arange(10.0)
    assert plan.own(vector).tolist() == [5.0, 6.0, 7.0]


# ---------------------------------------------------------------------------- ShardedNorms
def test_measure_and_take_equal_torchs_norm(mesh):
    model = Sharded(mesh)
    model.grads()
    norms = ShardedNorms(ParamIndex(model))
    positions, local = norms.measure(scaled=False)
    assert positions == [0, 1, 2]
    taken = norms.take()
    assert list(taken.positions) == [0, 1, 2]
    total = float(taken.norms.pow(2).sum().sqrt())
    assert total == pytest.approx(torch_norm(model), rel=1e-6)
    assert norms.take() is None  # handed over once


def test_a_parameter_without_a_gradient_counts_zero(mesh):
    model = Sharded(mesh)
    model.grads()
    model.w2.grad = None
    norms = ShardedNorms(ParamIndex(model))
    positions, _ = norms.measure(scaled=False)
    assert positions == [0, 2]
    taken = norms.take().norms
    assert float(taken[1]) == 0.0
    expected = torch.linalg.vector_norm(model.w1.grad.full_tensor())
    assert float(taken[0]) == pytest.approx(float(expected), rel=1e-6)


def test_a_failed_measurement_still_reduces_and_reports_zeros(mesh, monkeypatch):
    model = Sharded(mesh)
    model.grads()
    norms = ShardedNorms(ParamIndex(model))

    def broken(tensors):
        raise RuntimeError("the fused pass failed")

    monkeypatch.setattr(dtensor_norms, "per_param_norms", broken)
    with pytest.raises(RuntimeError, match="the fused pass failed"):
        norms.measure(scaled=False)
    taken = norms.take()
    assert taken is not None, "the reduction must be issued even when the pass failed"
    assert taken.norms.tolist() == [0.0, 0.0, 0.0]  # zeros, never NaN


def test_take_later_defers_on_cpu_and_fills_on_finish(mesh):
    model = Sharded(mesh)
    model.grads()
    norms = ShardedNorms(ParamIndex(model))
    norms.measure(scaled=False)
    errors: list = []
    vector, deferred = norms.take_later(lambda probe, exc: errors.append((probe, exc)))
    assert deferred is not None
    deferred.finish()
    assert not deferred.failed and errors == []
    total = float(vector.norms.pow(2).sum().sqrt())
    assert total == pytest.approx(torch_norm(model), rel=1e-6)


def test_clip_reuses_the_step_reduction_once_and_not_after_a_change(mesh):
    model = Sharded(mesh)
    model.grads()
    params = list(model.parameters())
    norms = ShardedNorms(ParamIndex(model))
    norms.measure(scaled=False)
    reused = norms.reuse_for_clip(params, scaled_now=False, scale=None)
    assert reused is not None
    assert float(reused) == pytest.approx(torch_norm(model), rel=1e-6)
    assert norms.reuse_for_clip(params, scaled_now=False, scale=None) is None  # once only

    norms.take()
    norms.measure(scaled=False)
    model.w1.grad.mul_(2.0)  # changed after the measurement: the stamp no longer matches
    assert norms.reuse_for_clip(params, scaled_now=False, scale=None) is None


def test_clip_divides_out_a_scale_applied_since_the_measurement(mesh):
    model = Sharded(mesh)
    model.grads(scale=1024.0)
    params = list(model.parameters())
    norms = ShardedNorms(ParamIndex(model))
    norms.measure(scaled=True)
    reused = norms.reuse_for_clip(params, scaled_now=False, scale=torch.tensor(1024.0))
    assert float(reused) == pytest.approx(torch_norm(model) / 1024.0, rel=1e-6)


def test_clip_of_other_parameters_is_not_reused(mesh):
    model = Sharded(mesh)
    model.grads()
    norms = ShardedNorms(ParamIndex(model))
    norms.measure(scaled=False)
    # a subset of the measured parameters is another norm: measured again, not reused
    assert norms.reuse_for_clip([model.w1], scaled_now=False, scale=None) is None
    other = torch.nn.Parameter(torch.zeros(2))
    other.grad = torch.ones(2)
    norms.take()
    norms.measure(scaled=False)
    assert norms.reuse_for_clip([other], scaled_now=False, scale=None) is None


# ---------------------------------------------------------------------------- DeferredReduction
class FakeWork:
    """A collective's ``Work`` whose completion the test controls."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.released = threading.Event()
        self.error = error

    def is_completed(self) -> bool:
        return self.released.is_set()

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        self.released.wait(5)
        return True


def test_deferred_fills_run_once_the_collective_is_done():
    work = FakeWork()
    filled: list[str] = []
    deferred = DeferredReduction(work, lambda: filled.append("norms"), lambda *_: None)
    deferred.also(lambda: filled.append("pp"))
    assert not deferred.done()
    work.released.set()
    assert deferred.done()
    deferred.finish()
    assert filled == ["norms", "pp"]
    deferred.finish()  # a second finish does nothing
    assert filled == ["norms", "pp"]
    deferred.also(lambda: filled.append("late"))  # after finish: runs at once
    assert filled == ["norms", "pp", "late"]


def test_a_failed_collective_marks_the_step_and_is_reported_not_raised():
    errors: list = []
    boom = RuntimeError("gloo: connection reset")
    filled: list[str] = []
    deferred = DeferredReduction(
        FakeWork(error=boom), lambda: filled.append("x"), lambda p, e: errors.append((p, e))
    )
    deferred.finish()  # must not raise
    assert deferred.failed
    assert errors == [("grads", boom)]
    assert filled == []
    deferred.also(lambda: filled.append("late"))  # a failed step fills nothing later either
    assert filled == []


def test_a_work_that_cannot_say_counts_as_done():
    class Mute:
        def is_completed(self):
            raise RuntimeError("unsupported")

        def wait(self):
            return True

    assert DeferredReduction(Mute(), lambda: None, lambda *_: None).done()
    assert DeferredReduction(None, lambda: None, lambda *_: None).done()


# ---------------------------------------------------------------------------- FlaggedSum
def _world_sum(vector: torch.Tensor):
    return dist.all_reduce(vector, op=dist.ReduceOp.SUM, async_op=True)


def test_a_flagged_sum_carries_values_and_a_clear_mark(mesh):
    summed = FlaggedSum(_world_sum)
    assert summed.take() is None  # nothing issued yet
    got = summed.issue(lambda: torch.tensor([3.0, 4.0]), 2, torch.device("cpu"), "ctx")
    assert got is None and summed.pending is not None and summed.pending.work is not None
    taken = summed.take()
    assert taken is not None and summed.pending is None and taken.context == "ctx"
    assert taken.values.tolist() == [3.0, 4.0] and not bool(taken.failed)
    assert taken.vector.dtype == torch.float64
    assert taken.total().tolist() == [7.0, 0.0]
    assert taken.or_zeros(taken.values).tolist() == [3.0, 4.0]


def test_a_failed_measurement_is_still_issued_flagged_and_returned(mesh):
    """The rendezvous happens whatever the measurement did: zeros and the mark go into the
    collective, every rank reports zeros (never NaN), and the caller gets the exception."""
    summed = FlaggedSum(_world_sum)
    boom = ValueError("no gradients")

    def measure():
        raise boom

    assert summed.issue(measure, 3, torch.device("cpu")) is boom
    taken = summed.take()
    assert taken is not None and taken.work is None  # it was issued, then waited on
    assert bool(taken.failed) and taken.values.tolist() == [0.0, 0.0, 0.0]
    assert taken.or_zeros(torch.tensor([1.0, 2.0, 3.0])).tolist() == [0.0, 0.0, 0.0]
    # a measurement of the wrong width is a failure too, not a mismatched collective
    assert isinstance(summed.issue(lambda: torch.ones(2), 3, torch.device("cpu")), ValueError)
    assert summed.take().vector.numel() == 4
    assert failed_vector(2, torch.device("cpu")).tolist() == [0.0, 0.0, 1.0]


def test_a_measured_mark_travels_with_the_values(mesh):
    """Pipeline parallel passes on the mark of a sharded sum it read."""
    summed = FlaggedSum(_world_sum)
    assert summed.issue(lambda: (torch.tensor([5.0]), torch.tensor(True)), 1,
                        torch.device("cpu")) is None
    taken = summed.take()
    assert bool(taken.failed) and taken.total().tolist() == [5.0, 1.0]


def test_a_later_issue_waits_on_and_replaces_the_earlier_one(mesh):
    summed = FlaggedSum(_world_sum)
    summed.issue(lambda: torch.tensor([1.0]), 1, torch.device("cpu"))
    first = summed.pending
    summed.issue(lambda: torch.tensor([2.0]), 1, torch.device("cpu"))
    assert first is not None and first.work is None  # waited
    assert summed.take().values.tolist() == [2.0]


def test_take_later_hands_a_host_wait_to_the_record_thread(mesh):
    summed = FlaggedSum(_world_sum)
    summed.issue(lambda: torch.tensor([9.0]), 1, torch.device("cpu"))
    out = torch.zeros(1, dtype=torch.float64)
    taken = summed.take_later(lambda issued: out.copy_(issued.values), lambda *_: None)
    assert taken is not None and summed.pending is None
    issued, deferred = taken
    assert deferred is not None and issued.work is None  # the wait is the deferral's now
    deferred.finish()
    assert out.tolist() == [9.0]
    # nothing in flight (no collective): filled now, nothing deferred
    local = FlaggedSum(lambda vector: None)
    local.issue(lambda: torch.tensor([4.0]), 1, torch.device("cpu"))
    issued, deferred = local.take_later(lambda issued: out.copy_(issued.values), lambda *_: None)
    assert deferred is None and out.tolist() == [4.0]
    assert local.take_later(lambda issued: None, lambda *_: None) is None
