"""Loss spikes named (agent.spikes): a one-step learning-rate spike on one group is an event at
that step naming that group and the batch's sample ids; 1,000 clean steps have none; a spike
that does not recover within ``spike_recover_steps`` pages (the gauge and its event) until it
does; memory stays bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ddpmon
from ddpmon.agent.spikes import SAMPLE_STEPS_KEPT, SpikeDetector, SpikeSettings
from ddpmon.metrics.state import StepRecord
from tests.support.spikes import model_and_optimizer, train


def spike_events(run_dir: Path) -> list[dict]:
    events = []
    for path in run_dir.rglob("events.rank0.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["kind"].startswith("loss_spike"):
                events.append(event)
    return events


def monitored(tmp_path, **options):
    model, opt = model_and_optimizer()
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id="spikes", **options)
    assert mon.enabled, mon.error
    return model, opt, mon


def test_a_one_step_lr_spike_on_one_group_is_an_event_at_its_step_naming_it(tmp_path):
    model, opt, mon = monitored(tmp_path)
    train(mon, model, opt, 160, spike_at=120, group=1)  # group 1: "mid"
    mon.close()
    events = spike_events(tmp_path)
    spikes = [e for e in events if e["kind"] == "loss_spike"]
    assert len(spikes) == 1, events
    spike = spikes[0]
    assert spike["step"] == 120 and spike["group"] == "mid", spike
    assert spike["group_signal"] == "update_ratio" and spike["group_step"] == 120
    assert spike["sample_ids"] == list(range(120 * 64, 121 * 64))
    assert [e["kind"] for e in events] == ["loss_spike", "loss_spike_recovered"]  # no page


def test_a_thousand_clean_steps_have_no_spike_event(tmp_path):
    model, opt, mon = monitored(tmp_path)
    train(mon, model, opt, 1000)
    steps = mon.state.steps_total
    mon.close()
    assert steps == 1000
    assert spike_events(tmp_path) == []


def record(step: int, loss: float) -> StepRecord:
    return StepRecord(step=step, wall_time=float(step), duration_seconds=None,
                      data_wait_seconds=None, loss=loss, grad_norm=1.0,
                      group_norms={"a": 1.0, "b": 1.0})


@pytest.mark.parametrize("recovers", [True, False])
def test_only_a_spike_that_does_not_recover_pages(recovers):
    emitted, paged = [], []
    settings = SpikeSettings(window=32, recover_steps=5, warmup=8)
    detector = SpikeDetector(settings, lambda kind, step, **f: emitted.append((kind, step)),
                             paged.append)
    for step in range(40):
        detector.on_record(record(step, 1.0 + 0.01 * (step % 3)))
    for step in range(40, 60):
        high = step < 43 if recovers else step < 55
        detector.on_record(record(step, 5.0 if high else 1.0))
    if recovers:
        assert emitted == [("loss_spike", 40), ("loss_spike_recovered", 40)] and paged == []
    else:
        assert emitted == [("loss_spike", 40), ("loss_spike_unrecovered", 40),
                           ("loss_spike_recovered", 40)]
        assert paged == [40, None]  # set at the page, cleared at the recovery


def test_memory_is_bounded_by_the_window_and_the_groups():
    settings = SpikeSettings(window=16, lookback=4)
    detector = SpikeDetector(settings, lambda *a, **k: None, lambda step: None)
    for step in range(5000):
        detector.on_record(record(step, 1.0 + (step % 7) * 0.001))
        detector.note_samples(step, [step])
    assert all(len(b.values) <= 16 for b in detector._signals.values())
    assert len(detector._groups) == 2 and all(len(b.values) <= 16
                                              for b in detector._groups.values())
    # ids are kept as long as the readback can trail the loop, and no longer
    assert len(detector._samples) == SAMPLE_STEPS_KEPT < 5000 and len(detector._jumps) <= 16


def _spike_at_40(detector, emitted_before=40) -> None:
    for step in range(emitted_before):
        detector.on_record(record(step, 1.0 + 0.01 * (step % 3)))


def test_a_failed_emit_loses_no_event():
    """The open spike is set only once its event was written: an emit that fails (a full disk)
    is tried again at the next record instead of being lost."""
    emitted, failures = [], [1]

    def emit(kind, step, **fields):
        if failures:
            failures.pop()
            raise OSError("disk full")
        emitted.append((kind, step))

    detector = SpikeDetector(SpikeSettings(window=32, recover_steps=5, warmup=8), emit,
                             lambda step: None)
    _spike_at_40(detector)
    with pytest.raises(OSError):
        detector.on_record(record(40, 5.0))
    detector.on_record(record(41, 5.0))
    assert emitted == [("loss_spike", 41)] and detector.events == 1


def test_sample_ids_are_copied_when_noted_not_read_from_a_reused_buffer():
    import torch

    emitted = []
    detector = SpikeDetector(SpikeSettings(window=32, warmup=8),
                             lambda kind, step, **f: emitted.append(f), lambda step: None)
    buffer = torch.arange(4)
    _spike_at_40(detector)
    detector.note_samples(40, buffer)
    buffer.fill_(-1)  # a prefetching loader reuses its buffer for the next batch
    detector.on_record(record(40, 5.0))
    assert emitted[0]["sample_ids"] == [0, 1, 2, 3]


class _AppendsWhenCompared(int):
    """A step noted while the record thread looks the ids up: comparing it appends another
    note, as the training thread does concurrently."""

    detector = None

    def __eq__(self, other):
        self.detector.note_samples(int(self) + 1000, [0])
        return int(self) == other

    __hash__ = int.__hash__


def test_reading_ids_while_the_training_thread_notes_more_does_not_fail():
    emitted = []
    detector = SpikeDetector(SpikeSettings(window=32, warmup=8),
                             lambda kind, step, **f: emitted.append(f), lambda step: None)
    _spike_at_40(detector)
    _AppendsWhenCompared.detector = detector
    detector.note_samples(_AppendsWhenCompared(40), [8])
    detector.note_samples(_AppendsWhenCompared(41), [9])  # looked at first: it appends
    detector.on_record(record(40, 5.0))
    assert emitted[0]["sample_ids"] == [8]
