"""The step hooks never raise into training: a torch whose private autograd engine API, which the
end-of-backward callback uses (``Variable._execution_engine.queue_callback``), fails still
trains, counts every step, measures its gradients at the optimizer step and counts the failure."""

from __future__ import annotations

import torch
from torch import nn

import ddpmon


class _NoCallbacks:
    """The real engine (torch's own backward runs through it) without ``queue_callback``."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def queue_callback(self, callback) -> None:
        raise RuntimeError("queue_callback is gone in this torch")


def test_no_execution_engine_costs_the_boundary_not_the_step(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(model, opt, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id="no-engine")
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine",
                        _NoCallbacks(torch.autograd.Variable._execution_engine))
    try:
        theirs = []
        for _ in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()  # the hook's error must not surface here
            theirs.append(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            opt.step()
            opt.zero_grad()
        monkeypatch.undo()
        mon.flush()
        ours = [(r.step, r.grad_norm) for r in mon.recent_steps()]
        assert [s for s, _ in ours] == [0, 1, 2]
        for (_, norm), ref in zip(ours, theirs, strict=True):
            assert abs(norm - ref) <= 1e-6 * ref
        assert mon.state.agent_errors["step"] >= 1
    finally:
        monkeypatch.undo()
        mon.close()
