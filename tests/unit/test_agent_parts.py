"""The agent's parts in one process, without hooks or threads: the step pipeline driven by hand
with a scripted gradient source, the named step vector, the guard, the null monitor, and two
monitors in one process."""

import logging
import math
import threading
import time

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.agent.guard import Guard
from ddpmon.agent.policy import NonFiniteGradientError, NonFinitePolicy
from ddpmon.agent.step_flow import StepFlow
from ddpmon.agent.step_vector import STEP_SLOTS, Slot, StepVectorLayout
from ddpmon.probes.grads import NormVector, ParamIndex
from ddpmon.strategies.base import GradientSource, GradSummaries, StepExtension


class ScriptedSource(GradientSource):
    """Hands out the norms a test scripts, one step at a time (local = reduced)."""

    name = "scripted"

    def __init__(self, index, script):
        self.index = index
        self.script = list(script)
        self.backward_ends = 0

    def on_backward_end(self):
        self.backward_ends += 1

    def collect(self):
        norms = self.script.pop(0)
        vector = NormVector(torch.tensor(norms, dtype=torch.float64), list(range(len(norms))))
        return GradSummaries(reduced=vector, local_is_reduced=True)


class Collect:
    probe = "test"

    def __init__(self):
        self.records = []
        self.late = []

    def on_record(self, record):
        self.records.append(record)

    def on_late_cross_check(self, step, ours, theirs, mismatch):
        self.late.append((step, ours, theirs, mismatch))

    def close(self):
        pass


def make_pipeline(script, mode="record"):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))  # 4 parameters, 2 groups
    index = ParamIndex(model)
    errors = []
    guard = Guard(errors.append)
    sink = Collect()
    policy = NonFinitePolicy(mode, index, rank=0, emit=lambda *a, **k: None)
    source = ScriptedSource(index, script)
    pipe = StepFlow(source=source, index=index, guard=guard, policy=policy, sinks=[sink])
    return pipe, sink, errors, index


def one_step(pipe, loss=None):
    pipe.forward_started(())
    if loss is not None:
        pipe.observe_loss(loss)
    pipe.backward_ended()
    pipe.optimizer_pre((None,), {})
    pipe.optimizer_post()


def test_pipeline_turns_norms_into_records_with_global_and_group_norms():
    pipe, sink, errors, index = make_pipeline([[3.0, 4.0, 0.0, 12.0]])
    one_step(pipe, loss=torch.tensor(2.5))
    (r,) = sink.records
    assert r.step == 0 and r.loss == 2.5 and errors == []
    assert r.grad_norm == pytest.approx(13.0)
    assert r.group_norms == {"0": pytest.approx(5.0), "1": pytest.approx(12.0)}
    assert r.grad_local_norm == pytest.approx(13.0) and not r.origin


def test_origin_once_then_poisoned_steps_when_the_nan_is_applied():
    nan = float("nan")
    script = [[1.0, 1, 1, 1], [1.0, nan, 1, 1], [nan, nan, nan, nan], [nan] * 4]
    pipe, sink, _, index = make_pipeline(script)
    for _ in script:
        one_step(pipe)
    origin = [r.step for r in sink.records if r.origin]
    poisoned = [r.step for r in sink.records if r.poisoned]
    assert origin == [1] and poisoned == [2, 3]
    assert sink.records[1].local_nonfinite_param == index.names[1]
    assert sink.records[1].local_nonfinite_kind == "nan"


def test_a_skipped_nonfinite_step_does_not_poison_the_weights():
    inf = float("inf")
    pipe, sink, _, _ = make_pipeline([[1.0, inf, 1, 1], [1.0, inf, 1, 1], [1.0, 1, 1, 1]])
    for _ in range(2):  # the loop drops the gradients without stepping (guard and skip)
        pipe.forward_started(())
        pipe.backward_ended()
        pipe.complete(skipped_by="loop")
    one_step(pipe)
    assert [r.origin for r in sink.records] == [True, True, False]
    assert [r.skipped_by for r in sink.records] == ["loop", "loop", None]
    assert all(r.local_nonfinite_kind in (None, "inf") for r in sink.records)


def test_policy_raise_names_the_parameter_and_step():
    pipe, _, _, index = make_pipeline([[1.0, 1.0, float("nan"), 1.0]], mode="raise")
    pipe.forward_started(())
    pipe.backward_ended()
    with pytest.raises(NonFiniteGradientError, match=f"step 0 in parameter {index.names[2]}"):
        pipe.optimizer_pre((None,), {})


def test_closure_steps_collect_after_the_closure():
    pipe, sink, _, _ = make_pipeline([[1.0, 0, 0, 0], [2.0, 0, 0, 0]])
    for _ in range(2):
        left = len(pipe.source.script)
        pipe.optimizer_pre((None, lambda: None), {})  # closure: its backward has not run yet
        assert len(pipe.source.script) == left  # so nothing was collected
        pipe.forward_started(())
        pipe.backward_ended()
        pipe.optimizer_post()
    assert [r.grad_norm for r in sink.records] == [1.0, 2.0]


def test_trainer_norm_cross_check_counts_a_mismatch_on_the_readback_path():
    pipe, sink, _, _ = make_pipeline([[3.0, 4.0, 0, 0], [3.0, 4.0, 0, 0], [3.0, 4.0, 0, 0]])
    pipe.observe_grad_norm(5.0)  # agrees
    one_step(pipe)
    pipe.observe_grad_norm(torch.tensor(7.5))  # a device tensor: compared after readback
    one_step(pipe)
    one_step(pipe)
    pipe.observe_grad_norm(5.0 * 2, step=2)  # late, for a step already delivered
    assert [r.grad_norm_mismatch for r in sink.records] == [False, True, False]
    assert sink.records[1].trainer_grad_norm == 7.5


def test_a_device_norm_for_an_earlier_step_is_compared_there():
    pipe, sink, _, _ = make_pipeline([[3.0, 4.0, 0, 0]] * 3)
    one_step(pipe)
    pipe.observe_grad_norm(torch.tensor(6.0), step=0)  # rides on step 1's vector
    one_step(pipe)
    pipe.observe_grad_norm(torch.tensor(9.0), step=1)  # after the last step: read at close
    pipe.trainer_norms.flush()
    late = [c for c in sink.late]
    assert late == [(0, 5.0, 6.0, True), (1, 5.0, 9.0, True)]


def test_step_markers_install_all_or_nothing():
    """A marker that cannot install (a schedule whose ``step`` cannot be wrapped) takes the
    hooks installed before it off again, and its own error is the one raised."""
    from types import SimpleNamespace

    from ddpmon.agent.step_markers import StepMarkers
    from ddpmon.strategies.pipeline.probes import ScheduleStep

    class SlottedSchedule:  # no instance dict: the schedule step cannot be wrapped
        __slots__ = ()

        def step(self):
            pass

    class ScheduledSource(ScriptedSource):  # a strategy whose steps a schedule marks
        def markers(self, host):
            step = ScheduleStep(SimpleNamespace(schedule=SlottedSchedule()), host.steps,
                                host.on_error)
            step.install()
            return [step]

    pipe, _, _, _ = make_pipeline([])
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = ScheduledSource(pipe.source.index, [])
    with pytest.raises(TypeError):
        StepMarkers(model, opt, pipe, source, amp=None, on_error=print,
                    on_engine_step=print, on_engine_floor=print)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_attach_that_cannot_start_leaves_nothing_behind_and_training_goes_on(tmp_path, caplog):
    model = nn.Linear(2, 1)
    with caplog.at_level(logging.ERROR, logger="ddpmon"):
        mon = ddpmon.attach(model, object(), port=0, run_dir=str(tmp_path))  # not an optimizer
    assert not mon.enabled and "could not attach" in mon.error
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert any("could not attach" in r.getMessage() for r in caplog.records)
    model(torch.randn(3, 2)).sum().backward()  # the model still trains


def test_a_loop_that_never_calls_forward_still_gets_its_norms(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def loss(self, x):  # what Lightning's training_step and many scripts do
            return self.lin(x).pow(2).mean()

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path))
    try:
        for _ in range(3):
            model.loss(torch.randn(5, 4)).backward()
            expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            assert mon.state.grad_norm == pytest.approx(expected.item(), rel=1e-6)
    finally:
        mon.close()
    assert mon.state.steps_total == 3


def test_adding_a_step_vector_slot_is_one_declaration():
    layout = StepVectorLayout((*STEP_SLOTS, Slot("tokens", 1, "tokens this step")))
    vector, key = layout.pack(
        {"reduced_norms": torch.tensor([1.0, 2.0]), "tokens": torch.tensor([4096.0])}
    )
    values = layout.unpack(vector, key)
    assert values == {"reduced_norms": [1.0, 2.0], "tokens": [4096.0]}
    with pytest.raises(KeyError, match="unknown step-vector slot"):
        StepVectorLayout().pack({"tokens": torch.tensor([1.0])})
    with pytest.raises(ValueError, match="width 2, expected 1"):
        layout.pack({"tokens": torch.tensor([1.0, 2.0])})


def test_guard_counts_logs_once_and_swallows(caplog):
    counts = []
    guard = Guard(counts.append)
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        for _ in range(3):
            with guard("probe"):
                raise RuntimeError("boom")
    assert counts == ["probe"] * 3
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(KeyboardInterrupt), guard("probe"):
        raise KeyboardInterrupt  # never swallows what is not an Exception


def test_disabled_or_misconfigured_agent_is_a_null_monitor(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = ddpmon.attach(model, opt, enabled=False)
    bad = ddpmon.attach(model, opt, port=-1)
    for mon in (off, bad):
        assert not mon.enabled
        mon.observe_loss(1.0)
        mon.observe_grad_norm(1.0)
        mon.close()
    assert off.error is None and "port=-1" in bad.error
    assert not model._forward_pre_hooks  # nothing installed


def test_two_monitors_in_one_process_each_clip_their_own_model(tmp_path):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    mons = [
        ddpmon.attach(m, o, port=0, run_dir=str(tmp_path), run_id=f"m{i}")
        for i, (m, o) in enumerate(zip(models, opts, strict=True))
    ]
    try:
        for scale, (m, o, mon) in zip((1.0, 100.0), zip(models, opts, mons, strict=True),
                                      strict=True):
            loss = m(torch.randn(3, 4)).sum() * scale
            loss.backward()
            expected = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
            total = ddpmon.clip_grad_norm_(m.parameters(), 1.0)
            assert total.item() == pytest.approx(expected, rel=1e-6)
            o.step()
            o.zero_grad()
            assert mon.state.grad_norm == pytest.approx(expected, rel=1e-6)
            assert mon.state.steps_total == 1
    finally:
        for mon in mons:
            mon.close()
    assert not math.isclose(mons[0].state.grad_norm, mons[1].state.grad_norm)


class ThreadOf(Collect):
    """Records which thread delivered each step."""

    def on_record(self, record):
        self.records.append((record.step, threading.current_thread().name))


def test_in_background_the_hot_path_only_queues_and_a_drain_delivers_in_order():
    nan = float("nan")
    pipe, _, errors, _ = make_pipeline([[1.0, 2, 2, 4]] * 3 + [[1.0, nan, 1, 1]])
    sink = ThreadOf()
    pipe.sinks = [sink]
    pipe.background = True
    for _ in range(3):
        one_step(pipe, loss=torch.tensor(1.0))
    assert sink.records == [] and len(pipe.readback) == 3  # queued, nothing derived yet
    worker = threading.Thread(target=pipe.drain, args=(False,), name="drainer")
    worker.start()
    worker.join()
    assert sink.records == [(0, "drainer"), (1, "drainer"), (2, "drainer")]
    # Non-finite gradients already in host memory: delivered at once, on the step's thread,
    # so the evidence it triggers still sees that step's gradients.
    one_step(pipe)
    assert sink.records[-1] == (3, threading.current_thread().name) and errors == []


def test_a_full_queue_is_drained_on_the_training_thread_so_memory_stays_bounded():
    pipe, _, _, _ = make_pipeline([[1.0, 1, 1, 1]] * 5)
    sink = ThreadOf()
    pipe.sinks = [sink]
    pipe.background = True
    pipe.readback.max_pending = 2
    for _ in range(5):
        one_step(pipe)
        assert len(pipe.readback) < 2
    assert {name for _, name in sink.records} == {threading.current_thread().name}
    pipe.drain(wait=True)
    assert [step for step, _ in sink.records] == [0, 1, 2, 3, 4]  # nothing dropped


def test_monitor_runs_records_on_its_thread_and_readers_catch_up(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, run_dir=tmp_path, run_id="records")
    assert mon.enabled, mon.error
    sink = ThreadOf()
    mon.flow.sinks.append(sink)
    try:
        for _ in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        deadline = time.monotonic() + 10
        while len(sink.records) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # no reader: the record thread delivers on its own
        assert [s for s, _ in sink.records] == [0, 1, 2, 3]
        assert {name for _, name in sink.records} == {"ddpmon-records"}
        # A reader right after a step sees it: mon.state catches up first.
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        opt.step()
        assert mon.state.steps_total == 5
        assert mon.state.grad_norm == pytest.approx(expected, rel=1e-6)
    finally:
        mon.close()
    assert not mon.records.alive


# ------------------------------------------------------------------------- strategy extension
class TokensExtension(StepExtension):
    """A strategy's own per-step value, as docs/architecture.md's recipe adds one: a declared
    slot, its device tensor, its reading on the record thread (no agent module edited)."""

    replaces_global_norm = True
    SLOT = Slot("tokens_seen", 2, "tokens this step, and a global squared norm of its own")

    def __init__(self, tokens: float, squares: float) -> None:
        self.tokens = torch.tensor([tokens, squares], dtype=torch.float64)

    def values(self):
        return {self.SLOT.name: self.tokens}

    def decision_norm(self):
        return self.tokens[1:]

    def global_norm(self, parts):
        return math.sqrt(parts[self.SLOT.name][1])

    def finish(self, record, parts, local, reduced):
        record.trainer_grad_norm = parts[self.SLOT.name][0]  # a field the test can read back


class ExtendedSource(ScriptedSource):
    name = "extended"
    extra_slots = (TokensExtension.SLOT,)

    def collect(self):
        out = super().collect()
        out.extension = TokensExtension(tokens=512.0, squares=25.0)
        return out


def test_a_strategy_adds_its_own_slot_without_touching_the_pipeline():
    """The recipe 'add a parallelism strategy' with values of its own: the source declares
    ``extra_slots`` and hands a ``StepExtension``; the pipeline queues it, the policy reads its
    decision norm, build_record takes its global norm (the one writer) and calls its finish."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    index = ParamIndex(model)
    errors = []
    sink = Collect()
    pipe = StepFlow(
        source=ExtendedSource(index, [[3.0, 0.0, 4.0, 12.0]]), index=index,
        guard=Guard(errors.append), sinks=[sink],
        policy=NonFinitePolicy("record", index, 0, lambda *a, **k: None),
    )
    assert TokensExtension.SLOT in pipe.layout.slots and set(STEP_SLOTS) <= set(pipe.layout.slots)
    one_step(pipe)
    pipe.drain(wait=True)
    assert errors == []
    (record,) = sink.records
    assert record.grad_norm == 5.0  # the extension's, not the reduced norms' 13
    assert record.trainer_grad_norm == 512.0
    assert record.group_norms  # the common part still comes from the reduced norms


class BrokenEntry:
    """A probe whose take fails (a tensor-parallel block-entry probe gone wrong)."""

    def take(self):
        raise RuntimeError("take failed")

    def mark(self, record, sums):
        record.entry_block = None


def test_a_failing_probe_take_loses_its_own_values_not_the_step():
    pipe, sink, errors, _ = make_pipeline([[3.0, 4.0, 0.0, 12.0]])
    pipe.entry = BrokenEntry()
    one_step(pipe, loss=torch.tensor(2.5))
    (r,) = sink.records
    assert r.grad_norm == pytest.approx(13.0) and r.loss == 2.5
    assert errors == ["entry"]


def test_a_step_that_fails_before_its_split_finished_resets_the_split():
    class BrokenParts:  # fails in the step's packaging, before the split is read
        def take(self, guard):
            raise RuntimeError("packaging failed")

    pipe, sink, errors, _ = make_pipeline([[3.0, 4.0, 0.0, 12.0]])
    pipe.probes = BrokenParts()
    one_step(pipe)
    assert errors == ["step"] and sink.records == []
    assert pipe.split._step_start is None and pipe.split._forward == 0.0
