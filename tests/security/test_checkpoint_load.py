"""The demo entry point's ``--resume`` loads checkpoints weights-only: a pickle planted in a
checkpoint directory (which a job submitter can name with ``--checkpoint-dir``) is refused with
one message and never runs; a checkpoint the demo wrote itself still loads."""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import pytest
import torch

from ddpmon.agent.api import NullMonitor
from ddpmon.demo.checkpointing import CheckpointRefused, DemoCheckpoints

NO_AGENT = NullMonitor("test: no agent")


class Planted:
    """What an attacker pickles: unpickling it calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def checkpoints(directory: Path) -> DemoCheckpoints:
    args = argparse.Namespace(
        checkpoint_every=1, resume=True, resume_without=[], checkpoint_dir=str(directory),
        run_dir=None, run_id=None,
    )
    return DemoCheckpoints(args, rank=0)


def parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return model, opt, scaler


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code-ran"
    (tmp_path / "step-000010.pt").write_bytes(pickle.dumps({"model": Planted(marker), "step": 10}))
    model, opt, scaler = parts()
    with pytest.raises(CheckpointRefused, match="not a weights-only checkpoint"):
        checkpoints(tmp_path).resume(model, opt, scaler, False, NO_AGENT)
    assert not marker.exists(), "unpickling the planted checkpoint ran its code"


def test_a_checkpoint_the_demo_wrote_loads_back(tmp_path):
    model, opt, scaler = parts()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    saver = checkpoints(tmp_path)
    saver.after_step(4, model, opt, scaler, NO_AGENT)  # step 5 done: step-000005.pt
    fresh, fresh_opt, fresh_scaler = parts()
    start = checkpoints(tmp_path).resume(fresh, fresh_opt, fresh_scaler, False, NO_AGENT)
    assert start == 5
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_a_file_of_another_shape_is_refused(tmp_path):
    torch.save([1, 2, 3], tmp_path / "step-000003.pt")
    model, opt, scaler = parts()
    with pytest.raises(CheckpointRefused, match="not a ddpmon demo checkpoint"):
        checkpoints(tmp_path).resume(model, opt, scaler, False, NO_AGENT)
