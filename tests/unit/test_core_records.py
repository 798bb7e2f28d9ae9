"""A step's record from read-back values (``build_record``) and the origin/poisoned rule
(``OriginTracker``), directly: no rank, no process group, plain host numbers in."""

from __future__ import annotations

import math

import pytest
import torch

from ddpmon.agent.guard import Guard
from ddpmon.agent.policy import OriginTracker
from ddpmon.agent.records import StepMeta, build_record
from ddpmon.metrics.state import StepRecord
from ddpmon.probes.grads import NormVector, ParamIndex
from ddpmon.strategies.base import GradSummaries


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(2, 2)  # enc.weight, enc.bias: positions 0, 1
        self.head = torch.nn.Linear(2, 1)  # head.weight, head.bias: positions 2, 3


@pytest.fixture
def index() -> ParamIndex:
    return ParamIndex(Net())


def meta(step: int = 7, **kw) -> StepMeta:
    """A step's host facts; ``reduced``, ``local``, ``local_complete``, ``local_is_reduced`` and
    ``comm`` go into its ``GradSummaries``, as a source collects them."""
    summary_fields = {k: kw.pop(k) for k in ("reduced", "local", "local_complete",
                                             "local_is_reduced", "comm") if k in kw}
    fields = dict(
        step=step, wall_time=1000.0, duration=0.5, data_wait=0.1,
        summaries=GradSummaries(**summary_fields), loss_host=None,
        trainer_norm_host=None, trainer_norm_step=None, skipped_by=None,
    )
    fields.update(kw)
    return StepMeta(**fields)


def vector(positions=(0, 1, 2, 3), scaled=False) -> NormVector:
    return NormVector(torch.zeros(len(positions)), list(positions), scaled)


def record_of(parts, m, index, **kw) -> StepRecord:
    errors: list[str] = []
    rec = build_record(parts, m, index, Guard(errors.append), **kw)
    assert errors == [], f"probes failed while building the record: {errors}"
    return rec


# ---------------------------------------------------------------------------- build_record
def test_global_group_and_local_norms_from_the_read_back_values(index):
    parts = {"reduced_norms": [3.0, 0.0, 4.0, 0.0], "local_norms": [1.0, 0.0, 0.0, 0.0],
             "loss": [0.25]}
    rec = record_of(parts, meta(reduced=vector(), local=vector()), index)
    assert rec.step == 7 and rec.duration_seconds == 0.5 and rec.data_wait_seconds == 0.1
    assert rec.grad_norm == pytest.approx(5.0)
    assert rec.group_norms == {"enc": pytest.approx(3.0), "head": pytest.approx(4.0)}
    assert rec.grad_local_norm == pytest.approx(1.0)
    assert rec.loss == 0.25
    assert not rec.grad_nonfinite and not rec.local_nonfinite


def test_the_first_nonfinite_parameter_is_named_in_backward_order(index):
    """No backward seen (no measured order): reverse registration, nearest the loss first."""
    parts = {"reduced_norms": [1.0, math.inf, math.nan, 1.0],
             "local_norms": [math.inf, 1.0, math.nan, 1.0]}
    rec = record_of(parts, meta(reduced=vector(), local=vector()), index)
    assert rec.grad_nonfinite and rec.grad_nonfinite_param == "head.weight"
    assert rec.grad_nonfinite_kind == "nan"
    assert rec.local_nonfinite and rec.local_nonfinite_param == "head.weight"
    assert rec.local_nonfinite_kind == "nan"


def test_scaled_norms_are_divided_by_the_loss_scale_read_back(index):
    parts = {"reduced_norms": [0.0, 0.0, 0.0, 512.0], "grad_scale": [256.0],
             "loss_scale": [256.0]}
    rec = record_of(parts, meta(reduced=vector(scaled=True)), index)
    assert rec.grad_norm == pytest.approx(2.0)
    assert rec.loss_scale == 256.0


def test_a_failed_host_reduction_leaves_no_global_norm(index):
    parts = {"reduced_norms": [3.0, 0.0, 4.0, 0.0]}
    rec = record_of(parts, meta(reduced=vector()), index, reduction_failed=True)
    assert rec.grad_norm is None and rec.group_norms == {}


def test_partial_local_norms_report_their_flag_but_not_a_norm(index):
    parts = {"local_norms": [math.nan, 2.0]}
    rec = record_of(parts, meta(local=vector((1, 3)), local_complete=False), index)
    assert rec.grad_local_norm is None
    assert rec.local_nonfinite and rec.local_nonfinite_param == "enc.bias"


def test_a_single_process_model_uses_the_reduced_norms_as_local(index):
    parts = {"reduced_norms": [0.0, 0.0, 3.0, 4.0]}
    rec = record_of(parts, meta(reduced=vector(), local_is_reduced=True), index)
    assert rec.grad_local_norm == pytest.approx(5.0)


def test_found_inf_and_host_counters_mark_a_scaler_skip(index):
    rec = record_of({"found_inf": [1.0]}, meta(), index)
    assert rec.amp_skipped and rec.skipped_by == "scaler"
    rec = record_of({}, meta(host_skipped=True, host_scale_after=128.0), index)
    assert rec.amp_skipped and rec.skipped_by == "scaler" and rec.loss_scale == 128.0
    rec = record_of({"found_inf": [1.0]}, meta(skipped_by="policy"), index)
    assert rec.skipped_by == "policy"  # the first to skip keeps the name
    rec = record_of({"found_inf": [0.0]}, meta(), index)
    assert not rec.amp_skipped and rec.skipped_by is None


def test_host_loss_and_identical_ranks(index):
    rec = record_of({"identical_ranks": [1.0]}, meta(loss_host=1.5), index)
    assert rec.loss == 1.5
    assert rec.data_identical_ranks == 1


# ---------------------------------------------------------------------------- OriginTracker
def step(n: int, *, local=False, grad=False, skipped_by=None) -> StepRecord:
    rec = StepRecord(step=n, wall_time=0.0, duration_seconds=None, data_wait_seconds=None)
    rec.local_nonfinite, rec.grad_nonfinite, rec.skipped_by = local, grad, skipped_by
    return rec


def test_the_first_local_nonfinite_is_the_origin_and_later_steps_are_poisoned():
    tracker = OriginTracker()
    clean = step(1)
    tracker.classify(clean)
    assert not clean.origin and not clean.poisoned
    first = step(2, local=True, grad=True)
    tracker.classify(first)
    assert first.origin and not first.poisoned
    later = step(3, local=True, grad=True)
    tracker.classify(later)
    assert later.poisoned and not later.origin
    assert tracker.poisoned_since == 2


def test_a_skipped_step_does_not_poison_the_weights():
    tracker = OriginTracker()
    tracker.classify(step(2, local=True, grad=True, skipped_by="scaler"))
    assert tracker.poisoned_since is None
    again = step(3, local=True, grad=True)
    tracker.classify(again)
    assert again.origin, "after a skipped step the weights are clean: a new origin"


def test_a_rank_that_only_received_a_nan_is_no_origin():
    tracker = OriginTracker()
    received = step(5, local=False, grad=True)
    tracker.classify(received)
    assert not received.origin and not received.poisoned
    own = step(6, local=True, grad=True)
    tracker.classify(own)
    assert own.poisoned, "the NaN applied at step 5 poisoned every later gradient"


def test_reset_starts_a_new_attempt_clean():
    tracker = OriginTracker()
    tracker.classify(step(2, local=True, grad=True))
    tracker.reset()
    rec = step(3, local=True, grad=True)
    tracker.classify(rec)
    assert rec.origin


def test_every_step_slot_is_named_by_one_constant():
    """The slots' names live in ddpmon.metrics.step_slots: STEP_SLOTS declares exactly those, and
    the records and the pipeline source read them through the constants."""
    from ddpmon.agent.step_vector import STEP_SLOTS
    from ddpmon.metrics import step_slots

    constants = [v for k, v in vars(step_slots).items() if k.isupper()]
    assert sorted(s.name for s in STEP_SLOTS) == sorted(constants)
