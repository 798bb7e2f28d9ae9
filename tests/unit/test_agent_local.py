"""The agent in one process (no torch.distributed): real hooks, real HTTP, real failures."""

import logging
import socket

import pytest
import torch
from torch import nn

import ddpmon
from tests.support.ports import free_port
from tests.support.scrape import scrape


def poison_next_backward(param):
    """A NaN in ``param``'s gradient, produced by the next backward pass."""
    handle = None

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    handle = param.register_hook(hook)


def train(model, opt, mon, steps, poison_at=None):
    for step in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        mon.observe_loss(loss)
        if step == poison_at:
            poison_next_backward(model[0].weight)
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def model_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_plain_model_steps_norms_and_nonfinite(tmp_path, model_opt):
    model, opt = model_opt
    port = free_port()
    mon = ddpmon.attach(
        model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path), run_id="local"
    )
    try:
        train(model, opt, mon, 6, poison_at=3)
        m = scrape(port)
    finally:
        mon.close()
    assert m[("ddpmon_steps_total", ())] == 6
    assert m[("ddpmon_step", ())] == 5
    assert m[("ddpmon_step_duration_seconds_count", ())] == 6
    assert m[("ddpmon_data_wait_seconds_count", ())] == 5
    # The NaN step poisons the weights, so steps 3, 4 and 5 all have non-finite gradients.
    assert m[("ddpmon_grad_nonfinite_steps_total", ())] == 3
    # Without an all-reduce the local gradients are the reduced ones: this rank is the origin,
    # once; steps 4 and 5 are non-finite because step 3's NaN reached the weights.
    assert m[("ddpmon_grad_nonfinite_origin_steps_total", ())] == 1
    assert m[("ddpmon_grad_nonfinite_poisoned_steps_total", ())] == 2
    info = [k for k in m if k[0] == "ddpmon_grad_first_nonfinite_info"]
    assert dict(info[0][1]) == {"kind": "nan", "param": "0.weight", "step": "3"}
    assert m[("ddpmon_grad_norm", ())] != m[("ddpmon_grad_norm", ())]  # NaN, exposed as such
    assert ("ddpmon_amp_loss_scale", ()) not in m  # no scaler, no AMP series
    assert (tmp_path / "local" / "summary.rank0.json").exists()


def test_close_is_idempotent_and_frees_the_port(tmp_path, model_opt):
    model, opt = model_opt
    port = free_port()
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
    train(model, opt, mon, 2)
    mon.close()
    mon.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise if the server still listened
    assert not model._forward_pre_hooks
    train(model, opt, mon, 2)  # hooks are gone; training is unaffected


def test_port_in_use_warns_once_and_training_finishes(tmp_path, model_opt, caplog):
    model, opt = model_opt
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="ddpmon"):
            mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
        train(model, opt, mon, 3)
        mon.close()
    messages = [r.getMessage() for r in caplog.records if "in use" in r.getMessage()]
    assert len(messages) == 1
    assert str(port) in messages[0] and "DDPMON_PORT" in messages[0]
    assert mon.port is None and mon.state.steps_total == 3
    assert mon.state.agent_errors["server"] == 1


def test_failing_probe_is_counted_logged_once_and_training_continues(
    tmp_path, model_opt, caplog, monkeypatch
):
    import ddpmon.strategies.plain as plain

    def broken(*args, **kwargs):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(plain, "full_pass", broken)  # fault injection into the real agent
    model, opt = model_opt
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
        before = model[0].weight.detach().clone()
        train(model, opt, mon, 4)
        m = scrape(port)
        mon.close()
    assert not torch.equal(before, model[0].weight)  # the optimizer really stepped
    assert m[("ddpmon_agent_errors_total", (("probe", "grads"),))] == 4
    assert m[("ddpmon_steps_total", ())] == 4
    assert sum("probe exploded" in r.getMessage() for r in caplog.records) == 1


def test_nonfinite_loss_counts_and_exposition_survives(tmp_path, model_opt):
    model, opt = model_opt
    port = free_port()
    mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path))
    try:
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
        mon.observe_loss(torch.tensor(float("inf")))
        opt.step()
        opt.zero_grad()
        m = scrape(port)
    finally:
        mon.close()
    assert m[("ddpmon_loss", ())] == float("inf")
    assert m[("ddpmon_loss_nonfinite_total", ())] == 1


def test_the_manifest_is_on_disk_from_attach_and_rewritten_whole_after_the_first_step(
    tmp_path, model_opt
):
    """A run killed before its first step (SIGKILL, scancel, a segfault in the first forward)
    runs no more Python: what it leaves is what attach wrote. The first step's rewrite adds the
    batch shapes and keeps the attempt."""
    import json

    model, opt = model_opt
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id="early")
    try:
        manifest = tmp_path / "early" / "manifest.json"
        at_attach = json.loads(manifest.read_text())
        assert at_attach["run_id"] == "early" and at_attach["topology"]["world_size"] == 1
        assert at_attach["extra"]["group_names"] and not at_attach["batch_shapes"]
        train(model, opt, mon, 1)
        mon.flush()  # records reach the sinks on the record thread; deliver step 0's now
        after_step = json.loads(manifest.read_text())
    finally:
        mon.close()
    assert after_step["batch_shapes"], after_step
    assert after_step["attempt"] == at_attach["attempt"]
    assert after_step["previous_attempts"] == []
