"""`ddpmon top` against a real agent endpoint found through a real file_sd directory."""

import json
import subprocess
import sys

import torch
from torch import nn

import ddpmon
from tests.support.ports import free_port


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
        linger_seconds=0,  # published, but no store scrapes this test
    )
    try:
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()
            mon.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        # beside the live rank's file: one cut short, one of another shape
        (sd / "ddpmon-other-rank0.json").write_text('[{"targets": ["127.0.0.1:1"')
        (sd / "ddpmon-other-rank1.json").write_text('{"targets": ["127.0.0.1:1"]}')
        as_json = top("--sd-dir", str(sd), "--json")
        assert as_json.returncode == 0, as_json.stderr
        doc = json.loads(as_json.stdout)
        (values,) = doc["ranks"].values()
        assert values["ddpmon_step"] == 2 and values["rank"] == 0
        assert type(values["rank"]) is int and type(values["ddpmon_step"]) is int
        assert "Traceback" not in as_json.stderr
        named = {d["file"]: d["problem"] for d in doc["damaged"]}
        assert named.keys() == {"ddpmon-other-rank0.json", "ddpmon-other-rank1.json"}
        assert "truncated JSON" in named["ddpmon-other-rank0.json"]
        assert "not a list of target groups" in named["ddpmon-other-rank1.json"]
        assert f"ddpmon top: warning: {sd}/ddpmon-other-rank0.json: " in as_json.stderr
        for f in sd.glob("ddpmon-other-*.json"):
            f.unlink()
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
    nowhere = top("--sd-dir", str(tmp_path / "nope"))
    assert nowhere.returncode == 2 and "no such directory" in nowhere.stderr
