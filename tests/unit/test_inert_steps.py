"""An optimizer step that cannot change a weight is no training step: torch's
``_init_optim_state`` (what DCP's ``set_optimizer_state_dict`` and the FSDP2 example's loader
call) runs ``optimizer.step()`` with zero gradients at lr 0 to create the optimizer state. With
ddpmon attached before such a load, the steps after it are numbered as when it is attached after
it, and as the script counts them. A warm-up step at lr 0 with a forward and backward is still a
step."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import ddpmon
from ddpmon.agent.step_flow import is_inert_step


def _model_opt(lr: float = 0.01) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _train(model, opt, mon, steps: int) -> list[float]:
    """The script's own norms, from torch, one per step (clip at inf: measures, no change)."""
    torch.manual_seed(1)
    norms = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        mon.observe_loss(loss)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
    return norms


def _steps(mon) -> list[tuple[int, float | None]]:
    mon.flush()
    return [(r.step, r.grad_norm) for r in mon.recent_steps()]


def _run(tmp_path, load) -> tuple[list, list, int]:
    model, opt = _model_opt()
    saved = get_optimizer_state_dict(model, opt) if load == "dcp" else None
    model, opt = _model_opt()
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id=f"inert-{load}")
    try:
        if load == "init":
            _init_optim_state(opt)
            assert opt.state, "torch created the optimizer state by a step"
        elif load == "dcp":
            set_optimizer_state_dict(model, opt, saved)
        theirs = _train(model, opt, mon, 4)
        return _steps(mon), theirs, mon.flow.inert_steps
    finally:
        mon.close()


def test_init_optim_state_and_dcp_loads_are_not_steps(tmp_path):
    plain, theirs, none = _run(tmp_path, "none")
    assert none == 0 and [s for s, _ in plain] == [0, 1, 2, 3]
    for load in ("init", "dcp"):
        steps, norms, inert = _run(tmp_path, load)
        assert inert == 1, load
        assert [s for s, _ in steps] == [0, 1, 2, 3], (load, steps)
        # each recorded step is the script's step: its norm is torch's for that step
        for (_, ours), reference in zip(steps, norms, strict=True):
            assert abs(ours - reference) <= 1e-6 * reference, (load, ours, reference)


def test_a_warm_up_step_at_lr_zero_is_a_step(tmp_path):
    model, opt = _model_opt(lr=0.0)
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id="warmup")
    try:
        _train(model, opt, mon, 2)
        # a trainer that never calls the module's forward (no hook fires) but says a batch began
        mon.flow.batch_started()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        assert [s for s, _ in _steps(mon)] == [0, 1, 2]
        assert mon.flow.inert_steps == 0
    finally:
        mon.close()


def test_the_rule_reads_only_host_values():
    model, opt = _model_opt()
    assert not is_inert_step(opt)
    for group in opt.param_groups:
        group["lr"] = 0.0
    assert is_inert_step(opt)
    opt.param_groups[0]["lr"] = torch.tensor(0.0)
    assert is_inert_step(opt)  # a CPU tensor: reading it is no device sync
    opt.param_groups[0]["lr"] = torch.tensor(0.0, device="meta")
    assert not is_inert_step(opt)  # not on the host: counted, never read
    assert not is_inert_step(object())
