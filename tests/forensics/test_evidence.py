import json
import math
import os
import signal
import threading
import time

import pytest
import torch

from ddpmon.recorder.evidence import (
    EvidenceWriter,
    list_bundles,
    parse_bundle_name,
    read_bundle,
    tensor_summary,
)


def test_tensor_summary_counts_and_finite_stats():
    t = torch.tensor([1.0, -2.0, float("nan"), float("inf"), float("-inf"), 4.0, float("nan")])
    s = tensor_summary(t)
    assert s["shape"] == [7] and s["dtype"] == "float32" and s["numel"] == 7
    assert (s["nan"], s["posinf"], s["neginf"], s["inf"], s["finite"]) == (2, 1, 1, 2, 3)
    assert s["min"] == -2.0 and s["max"] == 4.0 and math.isclose(s["mean"], 1.0)
    assert math.isclose(s["finite_norm"], math.sqrt(21))
    allbad = tensor_summary(torch.full((2, 2), float("nan"), dtype=torch.float16))
    assert allbad["dtype"] == "float16" and allbad["nan"] == 4 and allbad["min"] is None
    ints = tensor_summary(torch.arange(5))
    assert ints["nan"] == 0 and ints["max"] == 4


def test_bundle_contents(tmp_path):
    w = EvidenceWriter(tmp_path, 1, tensor_max_elements=10)
    small = torch.tensor([1.0, float("nan")])
    big = torch.randn(100)
    path = w.write(
        "nonfinite", 20, {"param": "fc.weight"},
        tensors={"fc.weight.grad": small, "big.grad": big},
        records=[{"step": i, "loss": float(i)} for i in range(100)],
        extra={"scaler": {"scale": 65536.0}},
    )
    assert path == tmp_path / "evidence" / "rank1-step20-nonfinite"
    assert parse_bundle_name(path.name) == (1, 20, "nonfinite")
    b = read_bundle(path)
    assert b["info"]["param"] == "fc.weight" and b["rank"] == 1 and b["step"] == 20
    assert b["tensors"]["fc.weight.grad"]["nan"] == 1
    assert b["tensors"]["big.grad"]["numel"] == 100
    assert b["saved_tensors"] == ["fc.weight.grad"]  # the big one only as a summary
    assert torch.load(path / "fc.weight.grad.pt").isnan().sum() == 1
    assert not (path / "big.grad.pt").exists()
    assert len(b["records"]) == 64 and b["records"][-1]["step"] == 99
    assert b["extra"]["scaler"]["scale"] == 65536.0
    assert b["rng"]["torch_initial_seed"] == torch.initial_seed()
    stacks = (path / "stacks.txt").read_text()
    assert "test_bundle_contents" in stacks and "MainThread" in stacks
    for name in b["files"]:
        assert (path / name).exists()


def test_stacks_include_other_threads(tmp_path):
    stop = threading.Event()

    def parked_worker_function():
        stop.wait(10)

    t = threading.Thread(target=parked_worker_function, name="parked", daemon=True)
    t.start()
    try:
        path = EvidenceWriter(tmp_path, 0).write("stall", 3, {})
        text = (path / "stacks.txt").read_text()
        assert '"parked"' in text and "parked_worker_function" in text
    finally:
        stop.set()
        t.join()


def test_include_tensors_saves_big_ones(tmp_path):
    w = EvidenceWriter(tmp_path, 0, tensor_max_elements=4, include_tensors=True)
    path = w.write("nonfinite", 1, {}, tensors={"g": torch.ones(50)})
    assert torch.equal(torch.load(path / "g.pt"), torch.ones(50))


def test_inputs_never_saved_unless_opted_in(tmp_path):
    x = torch.arange(12.0).reshape(3, 4)
    off = EvidenceWriter(tmp_path / "a", 0).write("nonfinite", 1, {}, inputs={"x": x})
    assert not (off / "inputs").exists()
    info = read_bundle(off)
    assert info["inputs"]["x"]["shape"] == [3, 4] and info["inputs_saved"] is False
    assert not any(p.suffix == ".pt" and p.name != "rng_state.pt" for p in off.rglob("*"))
    on = EvidenceWriter(tmp_path / "b", 0, include_inputs=True).write(
        "nonfinite", 1, {}, inputs={"x": x}
    )
    assert torch.equal(torch.load(on / "inputs" / "x.pt"), x)


def test_bounded_per_kind_and_counted_on_disk(tmp_path):
    w = EvidenceWriter(tmp_path, 0, max_per_kind=2)
    assert w.write("nonfinite", 1, {}) is not None
    assert w.write("nonfinite", 2, {}) is not None
    assert w.write("nonfinite", 3, {}) is None  # bound reached
    assert w.write("stall", 3, {}) is not None  # another kind has its own bound
    again = EvidenceWriter(tmp_path, 0, max_per_kind=2)  # a restarted rank
    assert again.write("nonfinite", 4, {}) is None
    other_rank = EvidenceWriter(tmp_path, 1, max_per_kind=2)
    assert other_rank.write("nonfinite", 4, {}) is not None
    names = sorted(p.name for p in list_bundles(tmp_path))
    assert names == ["rank0-step1-nonfinite", "rank0-step2-nonfinite", "rank0-step3-stall",
                     "rank1-step4-nonfinite"]


def test_same_step_twice_gets_a_suffix(tmp_path):
    w = EvidenceWriter(tmp_path, 0)
    a = w.write("stall", 5, {})
    b = w.write("stall", 5, {})
    assert a.name == "rank0-step5-stall" and b.name == "rank0-step5-stall-2"
    assert parse_bundle_name(b.name) == (0, 5, "stall")


def test_write_never_raises(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    assert EvidenceWriter(blocker, 0).write("nonfinite", 1, {}) is None


KILL_WRITER = """
import sys, torch
from ddpmon.recorder.evidence import EvidenceWriter
w = EvidenceWriter(sys.argv[1] if len(sys.argv) > 1 else {run!r}, 0, include_tensors=True)
huge = torch.ones(48 * 1024 * 1024)  # 192 MiB: long enough a write to be killed inside
print("ready", flush=True)
w.write("nonfinite", 7, {{"param": "huge"}}, tensors={{"huge": huge}})
print("done", flush=True)
"""


def test_sigkill_mid_write_leaves_no_bundle(tmp_path, procs):
    run = tmp_path / "run"
    proc = procs.start(KILL_WRITER.format(run=str(run)))
    assert proc.stdout.readline().strip() == "ready"
    evidence = run / "evidence"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # kill as soon as anything of the bundle exists
        if evidence.is_dir() and any(evidence.iterdir()):
            break
        time.sleep(0.002)
    else:
        pytest.fail("the writer never started a bundle")
    os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and "done" not in out
    entries = [p.name for p in evidence.iterdir()]
    assert not (evidence / "rank0-step7-nonfinite").exists(), entries
    assert list_bundles(run) == []
    assert entries and all(name.startswith(".tmp-rank0-") for name in entries)
    # The next writer of this rank removes the dead process's temp dir and writes normally.
    w = EvidenceWriter(run, 0)
    assert [p.name for p in evidence.iterdir()] == []
    path = w.write("nonfinite", 7, {"param": "small"}, tensors={"g": torch.zeros(3)})
    assert json.loads((path / "info.json").read_text())["info"]["param"] == "small"
