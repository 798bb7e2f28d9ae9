"""PyTorch's own distributed examples, with one ``ddpmon.attach`` line and marked CPU patches
(``README.md``), under torchrun on 2 gloo ranks. Checked against the scripts' own numbers:

- the FSDP2 example (DCP state-dict API, bf16 mixed precision), trained and then resumed from its
  checkpoint: 10 steps each, numbered 0-9 as its loop counts them, with the resume's optimizer
  loading (torch's ``_init_optim_state``, an lr-0 step) not counted; ddpmon's global norm equals
  the norm ``clip_grad_norm_`` returns; its ranks are seeded alike and train on identical
  batches, which the duplicate-data check counts;
- the DDP tutorial, SIGSEGV on rank 1 after backward of its step 70, under
  ``torchrun --max-restarts 1``: the timeline names step 70, its phase and the tutorial's own
  ``_run_batch`` frame; the restarted attempt resumes from the tutorial's snapshot and runs to
  the end.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

from ddpmon.forensics.timeline import build_timeline
from ddpmon.recorder.history_read import read_history
from tests.support.ranks import RankOutput, run_launcher

HERE = Path(__file__).parent / "pytorch_examples"
FSDP2 = HERE / "FSDP2" / "example.py"
TUTORIAL = HERE / "ddp-tutorial-series" / "multigpu_torchrun.py"
REMOVED = "# ddpmon-removed: "
ADDED = "# ddpmon-patch"
STEPS = 10  # the FSDP2 example's own loop
SEGV_STEP = 70


def _upstream_blobs() -> dict[str, str]:
    table = (Path(__file__).parent / "README.md").read_text()
    return dict(re.findall(r"^\| `([^`]+)` \| `[^`]+` \| `([0-9a-f]{40})` \|$", table, re.M))


def upstream_text(path: Path) -> bytes:
    """The file as upstream published it: marked additions dropped, removals restored."""
    text = path.read_bytes().decode()
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith(REMOVED):
            out.append(line[len(REMOVED):])
        elif ADDED not in line:
            out.append(line)
    return "".join(out).encode()


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_vendored_files_are_upstream_plus_marked_patches():
    blobs = _upstream_blobs()
    assert len(blobs) == 6, blobs
    for rel, blob in blobs.items():
        assert git_blob(upstream_text(HERE / rel)) == blob, rel
    patched = [rel for rel in blobs if ADDED in (HERE / rel).read_text()]
    assert sorted(patched) == ["FSDP2/example.py", "ddp-tutorial-series/multigpu_torchrun.py"]


def _torchrun(script: Path, cwd: Path, run_id: str, *args: str, restarts: int = 0,
              env: dict[str, str] | None = None) -> RankOutput:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={restarts}", "--monitor-interval=0.5", str(script), *args]
    out = run_launcher(cmd, 240, cwd=cwd, env={
        "DDPMON_PORT": "0", "DDPMON_RUN_DIR": str(cwd / "runs"), "DDPMON_RUN_ID": run_id,
        **(env or {}),
    })
    return out


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> dict[str, tuple[RankOutput, Path]]:
    """The example trained from scratch, then resumed from the checkpoint it saved."""
    cwd = tmp_path_factory.mktemp("fsdp2-example")
    out = {}
    for run_id in ("fresh", "resumed"):
        done = _torchrun(FSDP2, cwd, run_id, "--dcp-api", "--mixed-precision",
                         env={"DDPMON_DATA_CHECK_INTERVAL": "5"})
        assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[run_id] = (done, cwd / "runs" / run_id)
    assert len(list((cwd / "checkpoints" / "dcp_api").iterdir())) == 2  # it did resume
    return out


def _script_norms(stdout: str) -> dict[int, float]:
    """What the example's ranks printed: one value per step (the ranks agree)."""
    seen: dict[int, set[str]] = {}
    for step, value in re.findall(r"step (\d+) grad_norm (\S+?)(?=step|\s|$)", stdout):
        seen.setdefault(int(step), set()).add(value)
    assert all(len(v) == 1 for v in seen.values()), seen
    return {step: float(next(iter(v))) for step, v in seen.items()}


@pytest.mark.parametrize("run_id", ["fresh", "resumed"])
def test_fsdp2_example_steps_and_norms_are_the_scripts(fsdp2, run_id):
    done, run = fsdp2[run_id]
    theirs = _script_norms(done.stdout)
    assert sorted(theirs) == list(range(STEPS))
    for rank in (0, 1):
        history = read_history(run / f"history.rank{rank}.arrow")
        steps = history.columns["step"].tolist()
        assert steps == list(range(STEPS)), (run_id, rank, steps)  # not 0-10: no lr-0 step
        for step, ours in zip(steps, history.columns["grad_norm"].tolist(), strict=True):
            assert ours == pytest.approx(theirs[step], rel=1e-5), (run_id, rank, step)
        summary = json.loads((run / f"summary.rank{rank}.json").read_text())
        assert summary["last_step"] == STEPS - 1, summary


@pytest.mark.parametrize("run_id", ["fresh", "resumed"])
def test_fsdp2_example_identical_batches_are_counted(fsdp2, run_id):
    """Every rank seeds alike (``torch.manual_seed(0)``) and draws its batch from the same
    generator: both train on identical batches, checked at steps 0 and 5."""
    _, run = fsdp2[run_id]
    timeline = build_timeline(run)
    identical = sorted((e["rank"], e["step"]) for e in timeline.events
                       if e["kind"] == "identical_data")
    assert identical == [(0, 0), (1, 0)], identical  # the event comes once per rank
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["data_check"] == {"every": 5, "over": "the FSDP2 reduce-scatter group"}
    assert manifest["strategy"] == "fsdp2" if "strategy" in manifest else True
    assert timeline.first_failure is None


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory) -> tuple[RankOutput, Path]:
    cwd = tmp_path_factory.mktemp("ddp-tutorial")
    done = _torchrun(TUTORIAL, cwd, "tutorial", "3", "1", restarts=1,
                     env={"SEGV_AT_STEP": str(SEGV_STEP)})
    assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, cwd / "runs" / "tutorial"


def test_ddp_tutorial_segfault_names_step_70_and_the_tutorials_frame(tutorial):
    _, run = tutorial
    ff = build_timeline(run).first_failure
    assert (ff["rank"], ff["kind"], ff["signal"], ff["attempt"]) == (1, "signal", "SIGSEGV", 0)
    assert (ff["step"], ff["phase"]) == (SEGV_STEP, "after backward"), ff
    assert ff["frame"].startswith(f"_run_batch ({TUTORIAL}:"), ff["frame"]


def test_ddp_tutorial_restart_resumes_from_its_snapshot_and_counts_its_steps(tutorial):
    done, run = tutorial
    # Epochs of 32 steps (2048 samples, 2 ranks, batch 32); the snapshot after epoch 1 says
    # EPOCHS_RUN=1, so the restarted attempt runs epochs 1 and 2 again: 64 steps by its count.
    assert "Resuming training from snapshot at Epoch 1" in done.stdout
    counted = [int(n) for n in re.findall(r"steps run (\d+)", done.stdout)]
    assert counted == [64, 64], done.stdout[-2000:]
    timeline = build_timeline(run)
    assert [a["attempt"] for a in timeline.recovery["attempts"]] == [0, 1]
    # Rank 1 died after its backward of step 70, whose all-reduces had completed: rank 0 finished
    # step 70 and failed in step 71's. The attempt's last step is its furthest rank's.
    assert [a["last_step"] for a in timeline.recovery["attempts"]] == [SEGV_STEP, 63]
    assert timeline.ranks[1]["last_step"] == 63
    for rank in (0, 1):
        assert timeline.ranks[rank]["ended"] == "closed (mon.close)", timeline.ranks[rank]
    # Only what the run has: no GradScaler, no RNG capture, nothing claimed restored or missing.
    text = json.dumps(timeline.recovery)
    assert "scaler" not in text, text
