"""``make gpu-check`` (scripts/gpu_check.py) where it finds no GPU (``CUDA_VISIBLE_DEVICES=""``,
so the test is the same on a GPU machine, whose real run is ``make gpu-check`` itself): it
skips the GPU steps with a reason each, still runs the sync audit (on the CPU, the GPU's
branches) and exits 0. The GPU benchmark's code runs here too, on a tiny model on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from benchmarks.gpu_overhead import measure, plan
from tests.support.ranks import REPO


def test_gpu_check_runs_as_far_as_the_machine_allows(tmp_path):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out",
                           str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert set(steps) == {"gpu_tests", "sync_audit", "nvml", "overhead"}
    assert steps["sync_audit"]["status"] == "ok", steps["sync_audit"]
    assert all(run["added"] == {} for run in steps["sync_audit"]["runs"].values())
    assert report["failed"] == [] and done.returncode == 0, done.stdout + done.stderr
    assert report["skipped"] == ["gpu_tests", "nvml", "overhead"]
    assert report["environment"]["cuda_available"] is False
    for name in report["skipped"]:
        assert "CUDA" in steps[name]["reason"] or "GPU" in steps[name]["reason"]
        assert f"gpu-check: {name}: skipped" in done.stdout
    assert "CPU with DDPMON_SYNC_AUDIT=1" in steps["sync_audit"]["mode"]


def test_the_model_is_sized_from_free_memory():
    per_layer = 12 * 2048 * 2048 + 13 * 2048
    layers = plan(80 * 2**30, 0.5, 2.0e9, 2048)
    assert 1.0e9 <= layers * per_layer <= 2.0e9  # >= 1B parameters on an 80 GB card
    assert plan(10**6, 0.5, 2.0e9, 2048) == 1  # never zero layers


def test_overhead_benchmark_code_runs_on_a_tiny_model():
    figures = measure(torch.device("cpu"), steps=2, fraction=0.5, max_params=2.0e5,
                      d_model=64, batch=1, seq=8)
    assert figures["params"] > 0 and figures["agent_errors"] == 0
    assert figures["agent_over_base"] > 0
