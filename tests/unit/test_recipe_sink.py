"""docs/architecture.md's "Add a sink", held: its example runs as written, on a real training
loop with the agent's real endpoint, and the sink gets every step in order, with the global
norm torch's own ``clip_grad_norm_`` returns."""

from __future__ import annotations

import json
import types

import torch
from torch import nn

import ddpmon
from ddpmon.agent.sinks import Sink
from tests.support.ports import free_port
from tests.support.recipe_code import recipe_code
from tests.support.scrape import scrape


def test_the_sink_recipe_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's "steps.jsonl", here
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # the example's attach, on a free port and a run dir of the test's own
    attach = types.SimpleNamespace(attach=lambda *a, **kw: ddpmon.attach(
        *a, port=free_port(), bind="127.0.0.1", run_dir=str(tmp_path / "runs"), **kw))
    scope = {"__name__": "recipe", "model": model, "optimizer": optimizer, "ddpmon": attach}
    code = recipe_code("Add a sink").replace("import ddpmon\n", "")  # attach comes from scope
    exec(compile(code, "docs/architecture.md", "exec"), scope)  # noqa: S102
    mon = scope["mon"]
    assert mon.enabled, mon.error
    assert [type(s).__name__ for s in mon.user_sinks] == ["StepLines"]
    assert isinstance(mon.user_sinks[0], Sink)
    norms = []
    try:
        for _ in range(5):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            optimizer.step()
            optimizer.zero_grad()
        assert scrape(mon.port)  # the agent serves beside the sink
    finally:
        mon.close()
    # the example opened steps.jsonl twice (the isinstance check, then attach): one file
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4]
    for line, torchs in zip(lines, norms, strict=True):
        assert abs(line["grad_norm"] - torchs) <= 1e-5 * max(1.0, torchs)
