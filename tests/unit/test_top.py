"""`ddpmon top` against a real agent endpoint found through a real file_sd directory."""

import json
import subprocess
import sys

import torch
from torch import nn

import ddpmon
from tests.support.demo import free_port


def top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "top", "--once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "250", "PATH": "/usr/bin"},
    )


def test_top_lists_live_ranks_and_marks_dead_ones(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sd = tmp_path / "sd"
    mon = ddpmon.attach(
        model,
        opt,
        port=free_port(),
        bind="127.0.0.1",
        run_dir=str(tmp_path),
        run_id="toprun",
        sd_dir=str(sd),
    )
    try:
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()
            mon.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        as_json = top("--sd-dir", str(sd), "--json")
        assert as_json.returncode == 0, as_json.stderr
        ranks = json.loads(as_json.stdout)["ranks"]
        (values,) = ranks.values()
        assert values["ddpmon_step"] == 2 and values["rank"] == 0
        dead = f"127.0.0.1:{free_port()}"
        table = top("--targets", f"127.0.0.1:{mon.port}", dead)
        assert table.returncode == 0, table.stderr
        assert f"{dead} down" in table.stdout
        assert "numerics" in table.stdout and "communication" in table.stdout
    finally:
        mon.close()
    assert not list(sd.glob("*.json"))  # the rank unpublished itself on close
    empty = top("--sd-dir", str(sd))
    assert empty.returncode == 1 and "no rank endpoints found" in empty.stdout
