"""``on_nonfinite='rerun'`` at world size 1, with loops written as closure loops are: zero_grad,
forward (with dropout: the rerun must draw the same random numbers), backward, return the loss.
The multi-rank proof (DDP, HSDP, 4 ranks, the timeline's verdict) is
tests/parallel/test_reruns.py."""

import json
import logging

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.agent.policy import NonFiniteGradientError
from ddpmon.config import ConfigError
from ddpmon.forensics.timeline import build_timeline
from tests.support.ports import free_port
from tests.support.scrape import scrape


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 1))


class Faults:
    """Gradient faults on the first layer's weight: ``once`` at a step's first backward only
    (a transient), ``always`` at every backward of that step (the batch), ``scale`` multiplies
    the step's first backward's gradient (a finite jump that does not reproduce)."""

    def __init__(self, model, once=(), always=(), scale=()):
        self.param = model[0].weight
        self.once, self.always, self.scale = set(once), set(always), set(scale)
        self.step = 0
        self.backwards: dict[int, int] = {}

    def arm(self):
        n = self.backwards.get(self.step, 0)
        self.backwards[self.step] = n + 1
        if self.step in self.always or (self.step in self.once and n == 0):
            self._hook_once(lambda g: torch.full_like(g, float("nan")))
        elif self.step in self.scale and n == 0:
            self._hook_once(lambda g: g * 1e4)

    def _hook_once(self, change):
        handle = None

        def hook(grad):
            handle.remove()
            return change(grad)

        handle = self.param.register_hook(hook)


def train(model, opt, mon, faults, steps, masks=None):
    for step in range(steps):
        faults.step = step
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        mon.observe_samples(torch.arange(step * 8, step * 8 + 8))

        def closure(x=x, step=step):
            opt.zero_grad()
            out = model(x)
            if masks is not None:
                masks.setdefault(step, []).append(out.detach().clone())
            loss = out.pow(2).mean()
            faults.arm()
            loss.backward()
            return loss

        opt.step(closure)


def events(run_path, kind):
    lines = (run_path / "events.rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_a_one_off_nan_is_transient_its_step_skipped_and_training_goes_on(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    faults, masks = Faults(model, once=[3]), {}
    mon = ddpmon.attach(model, opt, port=free_port(), bind="127.0.0.1",
                        run_dir=str(tmp_path), run_id="r", on_nonfinite="rerun")
    try:
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, mon, faults, 6, masks)
        mon.flush()
        exposed = scrape(mon.port)
        state = mon.state
    finally:
        mon.close()
    assert faults.backwards == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1}  # step 3 ran twice
    assert torch.equal(masks[3][0], masks[3][1])  # same batch, same dropout mask
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    (rerun,) = events(tmp_path / "r", "rerun")
    assert rerun["step"] == 3 and rerun["fault"] == "transient" and rerun["origin"] is True
    assert rerun["action"] == "skip" and rerun["trigger"] == "nonfinite"
    assert rerun["param"] == "0.weight" and rerun["device"] == "cpu"
    assert rerun["sample_ids"] == list(range(24, 32)) and rerun["sample_count"] == 8
    assert rerun["batch"] == [{"shape": [8, 4], "dtype": "float32"}]
    assert state.steps_total == 6  # the rerun is not a step of its own
    assert exposed[("ddpmon_step_reruns_total", (("fault", "transient"),))] == 1
    assert exposed[("ddpmon_step_reruns_total", (("fault", "deterministic"),))] == 0
    assert exposed[("ddpmon_steps_skipped_total", (("by", "policy"),))] == 1
    assert not events(tmp_path / "r", "nonfinite")  # the applied gradients were finite
    bundle = list((tmp_path / "r" / "evidence").glob("*rerun*"))
    assert bundle, list((tmp_path / "r").rglob("*"))
    timeline = build_timeline(tmp_path / "r")
    assert timeline.verdict["layer"] == "hardware"
    assert "transient on rank 0, cpu" in timeline.verdict["line"]


def test_a_batch_that_always_fails_is_deterministic_and_raises_naming_its_ids(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    faults = Faults(model, always=[2])
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r",
                        on_nonfinite="rerun")
    try:
        before = None
        with pytest.raises(NonFiniteGradientError, match=r"step 2 reproduced .* sample ids "
                                                         r"16-23"):
            for steps in (2, 3):  # steps 0-1, then step 2 raises
                if steps == 3:
                    before = [p.detach().clone() for p in model.parameters()]
                    faults.step = 2
                    x = torch.randn(8, 4)
                    mon.observe_samples(list(range(16, 24)))

                    def closure(x=x):
                        opt.zero_grad()
                        loss = model(x).pow(2).mean()
                        faults.arm()
                        loss.backward()
                        return loss

                    opt.step(closure)
                else:
                    train(model, opt, mon, faults, steps)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    finally:
        mon.close()
    (rerun,) = events(tmp_path / "r", "rerun")
    assert rerun["fault"] == "deterministic" and rerun["action"] == "raise"
    assert rerun["step"] == 2 and rerun["sample_ids"] == list(range(16, 24))
    verdict = build_timeline(tmp_path / "r").verdict
    assert verdict["layer"] == "numerics"
    assert "deterministic on rank 0" in verdict["line"] and "batch ids 16-23" in verdict["line"]


def test_a_norm_jump_is_rerun_only_when_asked_and_a_reproduced_one_is_applied(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    faults = Faults(model, scale=[12], always=[])
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r",
                        on_nonfinite="rerun", rerun_norm_jump=10)
    try:
        train(model, opt, mon, faults, 14)
        mon.flush()
    finally:
        mon.close()
    (rerun,) = events(tmp_path / "r", "rerun")
    assert rerun["step"] == 12 and rerun["trigger"] == "norm_jump"
    assert rerun["fault"] == "transient" and rerun["action"] == "skip"
    assert rerun["grad_norm"] > 100 * rerun["rerun_grad_norm"]
    with pytest.raises(ConfigError, match="rerun_norm_jump=10 needs on_nonfinite='rerun'"):
        ddpmon.Config(rerun_norm_jump=10)
    with pytest.raises(ConfigError, match="a factor above 1"):
        ddpmon.Config(on_nonfinite="rerun", rerun_norm_jump=0.5)


def test_steps_that_do_not_trigger_run_once_and_match_a_record_run(tmp_path):
    """The rerun policy costs a step nothing but its one read: same weights as ``record``."""
    finals = []
    for mode in ("record", "rerun"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        faults = Faults(model)
        torch.manual_seed(1)
        mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path / mode),
                            on_nonfinite=mode)
        try:
            train(model, opt, mon, faults, 5)
        finally:
            mon.close()
        assert faults.backwards == dict.fromkeys(range(5), 1)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_a_loop_without_a_closure_is_skipped_as_under_skip_and_told_once(tmp_path, caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r",
                        on_nonfinite="rerun")
    try:
        with caplog.at_level(logging.WARNING, logger="ddpmon"):
            faults = Faults(model, always=[1])
            for step in range(3):
                faults.step = step
                loss = model(torch.randn(8, 4)).pow(2).mean()
                faults.arm()
                loss.backward()
                opt.step()
                opt.zero_grad()
        mon.flush()
        skipped = dict(mon.state.steps_skipped_total)
    finally:
        mon.close()
    told = [r for r in caplog.records if "optimizer.step(closure)" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert skipped["policy"] == 1
    assert not events(tmp_path / "r", "rerun")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_micro_steps_outside_the_closure_are_not_rerun_but_skipped(tmp_path, caplog):
    """Gradient accumulation whose first micro-batches run before ``step(closure)``: the closure
    cannot replay them, so a non-finite step is skipped without a rerun, and ddpmon says so."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    faults = Faults(model, always=[1])
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r",
                        on_nonfinite="rerun")
    try:
        with caplog.at_level(logging.WARNING, logger="ddpmon"):
            for step in range(3):
                faults.step = step
                model(torch.randn(8, 4)).pow(2).mean().backward()  # micro-batch 1, outside

                def closure():
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    faults.arm()
                    loss.backward()
                    return loss

                opt.step(closure)
                opt.zero_grad()
        mon.flush()
        skipped = dict(mon.state.steps_skipped_total)
    finally:
        mon.close()
    assert faults.backwards == {0: 1, 1: 1, 2: 1}  # no rerun
    told = [r for r in caplog.records if "micro-steps outside the closure" in r.getMessage()]
    assert len(told) == 1
    assert skipped["policy"] == 1 and mon.state.steps_total == 3
    assert not events(tmp_path / "r", "rerun")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_step_handed_to_run_step_is_rerun_from_the_optimizer_step_that_follows(tmp_path):
    """``mon.run_step(closure)`` then ``optimizer.step()`` without a closure (the form a
    DeepSpeed loop needs, here with a torch optimizer): a one-off NaN at step 2 is transient
    and skipped, the batch that always fails at step 4 raises before anything is applied."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    faults, masks = Faults(model, once=[2], always=[4]), {}
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r",
                        on_nonfinite="rerun")
    weights = {}
    try:
        with pytest.raises(NonFiniteGradientError, match="step 4 reproduced on a rerun"):
            for step in range(6):
                faults.step = step
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))

                def forward_backward(x=x, step=step):
                    out = model(x)
                    masks.setdefault(step, []).append(out.detach().clone())
                    loss = out.pow(2).mean()
                    faults.arm()
                    loss.backward()
                    return loss

                opt.zero_grad()
                loss = mon.run_step(forward_backward)
                assert torch.isfinite(loss) or step in (2, 4)
                opt.step()
                weights[step] = model[0].weight.detach().clone()
        mon.flush()
    finally:
        mon.close()
    assert faults.backwards == {0: 1, 1: 1, 2: 2, 3: 1, 4: 2}
    assert torch.equal(masks[2][0], masks[2][1])  # the same dropout mask on the rerun
    assert torch.equal(weights[1], weights[2])  # the transient step was skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    transient, deterministic = events(tmp_path / "r", "rerun")
    assert (transient["step"], transient["fault"], transient["action"]) == (2, "transient", "skip")
    assert (deterministic["step"], deterministic["action"]) == (4, "raise")


def test_run_step_without_the_rerun_policy_just_runs_the_closure(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls = []
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), run_id="r")
    try:
        loss = mon.run_step(lambda: calls.append(1) or model(torch.ones(2, 4)).sum())
    finally:
        mon.close()
    assert calls == [1] and loss.shape == ()
    assert ddpmon.attach(model, opt, enabled=False).run_step(lambda: 7) == 7
