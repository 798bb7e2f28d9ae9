"""Checkpoint saves and loads on a real monitor: metrics over real HTTP, events, manifest recovery,
DCP capture through DCP's own logger, the attempt number."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp  # imported before attach, as scripts do
from torch import nn

import ddpmon
from ddpmon.agent.checkpoints import detect_attempt
from ddpmon.recorder.eventlog import read_events
from ddpmon.rundir.layout import RunDir
from tests.support.ports import free_port
from tests.support.scrape import scrape


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def run(tmp_path):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = free_port()
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path), run_id="ck")
    yield model, opt, mon, port, RunDir(tmp_path / "ck")
    mon.close()


def events(run_dir: RunDir, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir.events(0))[0] if e["kind"] == kind]


def test_save_is_timed_measured_and_exported(run, tmp_path):
    model, opt, mon, port, rd = run
    train(model, opt, 3)
    path = tmp_path / "step3.pt"
    with mon.observe_checkpoint(mon.step, path):
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    m = scrape(port)
    assert m[("ddpmon_checkpoint_last_step", ())] == 3
    assert m[("ddpmon_checkpoint_size_bytes", ())] == path.stat().st_size
    assert m[("ddpmon_checkpoint_duration_seconds_count", (("kind", "save"),))] == 1
    assert m[("ddpmon_attempt", ())] == 0
    (save,) = events(rd, "checkpoint_save")
    assert save["step"] == 3 and save["ok"] is True and save["bytes"] == path.stat().st_size
    assert save["attempt"] == 0 and save["source"] == "explicit" and save["seconds"] >= 0


def test_failed_save_is_an_event_not_a_checkpoint_and_the_error_propagates(run, tmp_path):
    model, opt, mon, port, rd = run
    train(model, opt, 1)
    target = tmp_path / "missing" / "x.pt"
    with pytest.raises(RuntimeError, match="does not exist"), mon.observe_checkpoint(1, target):
        torch.save({}, target)
    m = scrape(port)
    assert ("ddpmon_checkpoint_last_step", ()) not in m
    (failed,) = events(rd, "checkpoint_save")
    assert failed["ok"] is False and "missing" in failed["error"]


def test_load_before_first_step_rebases_steps_and_records_missing_state(run, tmp_path):
    model, opt, mon, port, rd = run
    path = tmp_path / "step30.pt"
    torch.save(model.state_dict(), path)
    with mon.observe_checkpoint(30, path, kind="load", model=True, optimizer=True, rng=False):
        model.load_state_dict(torch.load(path))
    train(model, opt, 2)
    m = scrape(port)
    assert m[("ddpmon_step", ())] == 31  # steps 30 and 31 were done after the resume
    assert m[("ddpmon_checkpoint_duration_seconds_count", (("kind", "load"),))] == 1
    (load,) = events(rd, "checkpoint_load")
    assert load["restored"] == ["model", "optimizer"]
    assert load["not_restored"] == ["rng"]
    assert load["not_stated"] == ["data_loader"]
    assert load["absent"] == ["scaler"]  # no GradScaler in this run: never claimed missing
    manifest = json.loads(rd.manifest().read_text())
    assert manifest["recovery"]["resume_step"] == 30
    assert manifest["recovery"]["path"] == str(path)
    assert manifest["recovery"]["not_restored"] == ["rng"]
    assert manifest["attempt"] == 0


def test_dcp_save_and_load_are_captured_once(run, tmp_path):
    model, opt, mon, port, rd = run
    train(model, opt, 2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp2"))
    with mon.observe_checkpoint(2, tmp_path / "dcp2b"):  # explicit wins, no double count
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp2b"))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp2"))
    saves, loads = events(rd, "checkpoint_save"), events(rd, "checkpoint_load")
    assert [(e["source"], e["step"]) for e in saves] == [("dcp.save", 2), ("explicit", 2)]
    assert saves[0]["path"] == str(tmp_path / "dcp2") and saves[0]["bytes"] > 0
    assert [e["source"] for e in loads] == ["dcp.load"]
    assert loads[0]["resume_step"] is None  # a captured load cannot know it
    assert mon.step == 2  # and does not renumber the steps
    assert loads[0]["not_stated"] == ["model", "optimizer", "rng", "data_loader"]
    m = scrape(port)
    assert m[("ddpmon_checkpoint_duration_seconds_count", (("kind", "save"),))] == 2
    assert m[("ddpmon_checkpoint_duration_seconds_count", (("kind", "load"),))] == 1


def test_bad_arguments_raise_clearly(run):
    _model, _opt, mon, _port, _rd = run
    with pytest.raises(ValueError, match="kind='restore'"):
        mon.observe_checkpoint(1, "x", kind="restore")
    with pytest.raises(ValueError, match="step=-1"):
        mon.observe_checkpoint(-1, "x")


def test_disabled_monitor_accepts_the_call():
    mon = ddpmon.attach(
        nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), enabled=False
    )
    with mon.observe_checkpoint(1, "x", kind="load", rng=True) as timer:
        pass
    timer.done()


def test_attempt_from_torchelastic_or_from_earlier_starts(tmp_path):
    rd = RunDir(tmp_path)
    assert detect_attempt(rd.events(0), rd.progress(0), {}).number == 0
    rd.events(0).write_text('{"kind":"start","rank":0}\n{"kind":"exit","rank":0}\n')
    rd.progress(0).write_text('{"step": 34, "ts": 5.0}\n')
    attempt = detect_attempt(rd.events(0), rd.progress(0), {})
    assert (attempt.number, attempt.source) == (1, "run_dir")
    assert attempt.previous_progress == {"step": 34, "ts": 5.0}
    elastic = detect_attempt(rd.events(0), rd.progress(0), {"TORCHELASTIC_RESTART_COUNT": "2"})
    assert (elastic.number, elastic.source) == (2, "torchelastic")
    bad = detect_attempt(rd.events(0), rd.progress(0), {"TORCHELASTIC_RESTART_COUNT": "x"})
    assert bad.number == 1


def test_evidence_bundles_carry_the_attempt(run, tmp_path):
    model, opt, mon, _port, rd = run
    train(model, opt, 1)
    handle = model.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    train(model, opt, 1)  # a local NaN on this rank: an origin, with an evidence bundle
    handle.remove()
    mon.close()
    (bundle,) = rd.bundles()
    info = json.loads((bundle / "info.json").read_text())
    assert info["info"]["attempt"] == 0 and info["step"] == 1 and info["kind"] == "nonfinite"


def test_dcp_async_save_counts_once_with_its_blocking_time(run, tmp_path):
    model, opt, mon, _port, rd = run
    train(model, opt, 1)
    dcp.async_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "a1")).result()
    (save,) = events(rd, "checkpoint_save")  # the background writer's own save is not counted
    assert save["source"] == "dcp.async_save" and save["async_write"] is True
    assert save["step"] == 1 and save["bytes"] is None  # not sized while still being written


def test_a_run_with_a_scaler_names_it_and_the_timeline_separates_unstated_from_missing(
    tmp_path, capsys
):
    """With a GradScaler the scaler is one of the run's states: a load that does not say it
    restored it lists it as not stated, which the timeline prints apart from NOT restored."""
    from ddpmon.cli import main

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mon = ddpmon.attach(model, opt, scaler=scaler, port=free_port(), bind="127.0.0.1",
                        run_dir=str(tmp_path), run_id="sc")
    try:
        path = tmp_path / "step5.pt"
        torch.save(model.state_dict(), path)
        with mon.observe_checkpoint(5, path, kind="load", model=True, rng=False):
            model.load_state_dict(torch.load(path))
        train(model, opt, 1)
    finally:
        mon.close()
    (load,) = events(RunDir(tmp_path / "sc"), "checkpoint_load")
    assert load["not_restored"] == ["rng"] and load["absent"] == []
    assert load["not_stated"] == ["optimizer", "scaler", "data_loader"]
    capsys.readouterr()
    main(["timeline", str(tmp_path / "sc")])
    out = " ".join(capsys.readouterr().out.split())
    assert "NOT restored: rng;" in out
    assert "restore not stated for: optimizer, scaler, data_loader" in out
