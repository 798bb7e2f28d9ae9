"""Precision as it is (strategies/precision.py), through a real ``attach`` on one process: the
parameters' dtype, autocast seen at the first forward, the GradScaler; the manifest and
``ddpmon_rank_info{precision}`` agree and stay within the declared labels. FSDP2's
MixedPrecisionPolicy is checked on real ranks (tests/parallel/test_mesh_shapes.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.strategies.precision import LABELS


def _run(tmp_path, name: str, *, dtype=torch.float32, autocast=None, scaler=False) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaler else None
    mon = ddpmon.attach(model, opt, grad_scaler, port=0, bind="127.0.0.1", run_dir=str(tmp_path),
                        run_id=name, announce=False)
    assert mon.enabled, mon.error
    at_attach = mon.state.precision
    for _ in range(2):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(torch.randn(4, 8, dtype=dtype)).float().square().mean()
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    label = mon.state.precision
    mon.close()
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    return {"attach": at_attach, "label": label, "manifest": manifest}


@pytest.mark.parametrize(
    ("name", "kw", "label", "detail"),
    [
        ("fp32", {}, "fp32", {"params": "fp32", "autocast": None, "gradscaler": False}),
        ("bf16", {"dtype": torch.bfloat16}, "bf16", {"params": "bf16", "storage": "bf16"}),
        ("amp", {"autocast": torch.bfloat16}, "amp-bf16", {"params": "fp32", "autocast": "bf16"}),
        ("scaler", {"autocast": torch.bfloat16, "scaler": True}, "amp-bf16+gradscaler",
         {"autocast": "bf16", "gradscaler": True}),
    ],
)
def test_label_and_manifest_say_what_the_model_trains_in(tmp_path, name, kw, label, detail):
    got = _run(tmp_path, name, **kw)
    assert got["label"] == label and label in LABELS
    assert got["manifest"]["precision"] == label
    facts = got["manifest"]["precision_detail"]
    assert {k: facts[k] for k in detail} == detail, facts
    assert facts["params_from"] == "parameters"
    if "autocast" not in kw:  # nothing to learn at the first forward: right from attach
        assert got["attach"] == label
