"""The step in flight on the exit path, in one process: the fields an exception's exit event
gets (``CrashCapture.in_flight``) and the ``nonfinite`` event of the step that never finished.
The crash capture's excepthook calls the same function; the two-rank tests
(tests/integration/test_exit_paths.py) run it for real."""

import json

import torch
from torch import nn

import ddpmon
from ddpmon.rundir.layout import RunDir


def events(run_path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_path).events(0).read_text().splitlines()]


def attach(tmp_path, run_id):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id=run_id)
    return model, opt, mon


def step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def test_a_nan_step_that_raises_is_reported_with_its_step_phase_and_origin(tmp_path):
    model, opt, mon = attach(tmp_path, "nan")
    try:
        assert mon.forensics.crash.in_flight() == {}  # no step has started: nothing to say
        for _ in range(3):
            step(model, opt, torch.randn(4, 8))
            opt.step()
        x = torch.randn(4, 8)
        x[1, 2] = float("nan")
        loss = step(model, opt, x)
        mon.observe_loss(loss)
        fields = mon.forensics.crash.in_flight()  # what the excepthook adds to the exit event
    finally:
        mon.close()
    assert fields == {"step": 3, "phase": "after backward", "running": True, "loss": "nan"}
    (nan,) = [e for e in events(mon.run_path) if e["kind"] == "nonfinite"]
    assert (nan["step"], nan["origin"], nan["running"], nan["nonfinite"]) == (3, True, True, "nan")
    # every gradient is NaN: the origin is the first in backward order, the layer nearest the loss
    assert nan["param"] in {"2.weight", "2.bias"}
    assert (tmp_path / "nan" / "evidence" / "rank0-step3-nonfinite").is_dir()


def test_a_failed_checkpoint_save_is_the_step_in_flights_checkpoint_phase(tmp_path):
    model, opt, mon = attach(tmp_path, "ckpt")
    try:
        step(model, opt, torch.randn(4, 8))
        opt.step()
        with mon.observe_checkpoint(1, tmp_path / "ok.pt"):
            torch.save(model.state_dict(), tmp_path / "ok.pt")
        assert mon.forensics.crash.in_flight()["phase"] == "before its forward"
        try:
            with mon.observe_checkpoint(1, tmp_path / "full.pt"):
                raise OSError(28, "No space left on device")
        except OSError:
            fields = mon.forensics.crash.in_flight()
    finally:
        mon.close()
    assert fields == {"step": 1, "phase": "in a checkpoint save or load", "running": True}
