"""DdpmonCallback in a real Transformers ``Trainer`` run: torchrun, 2 gloo ranks on CPU, a tiny
GPT-2 from a config, gradient_accumulation_steps=2, grad norm logged every step.

The reported norm is scaled by 1.5 at step 2 (a test-only callback); rank 1 gets a NaN in one
local gradient at step 5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.integrations import (
    WorkerRun,
    by_step,
    check_mismatch,
    check_nan_origin,
    check_norms,
    check_resume,
    check_steps,
    close,
    run_worker,
)
from tests.support.ports import free_port_pair
from tests.support.ranks import torchrun

WORKER = Path(__file__).with_name("transformers_worker.py")
STEPS, ACCUMULATE, WRONG_STEP, NAN_STEP, NAN_RANK = 6, 2, 2, 5, 1
NAN_PARAM = "transformer.h.0.mlp.c_fc.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    out = tmp_path_factory.mktemp("transformers")
    cmd = torchrun(WORKER, "--out", str(out), "--port", str(free_port_pair()))
    cmd += ["--steps", str(STEPS), "--accumulate", str(ACCUMULATE)]
    cmd += ["--wrong-step", str(WRONG_STEP), "--nan-step", str(NAN_STEP)]
    cmd += ["--nan-rank", str(NAN_RANK), "--full-checkpoints"]  # the resume starts from one
    result = run_worker(cmd, out, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    return result


def test_attaches_to_the_prepared_ddp_model(run: WorkerRun) -> None:
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["http_ok"] is True, f"/metrics did not answer during training: {res['http_ok']}"
        # The DDP comm hook saw the all-reduces: the callback found the DDP wrapper.
        assert (run.sample(rank, "ddpmon_collective_bytes_total", op="all_reduce") or 0) > 0


def test_counts_optimizer_steps_not_micro_batches(run: WorkerRun) -> None:
    check_steps(run, STEPS)


def test_grad_norm_equals_the_trainers_logged_norm(run: WorkerRun) -> None:
    check_norms(run, range(NAN_STEP))


def test_loss_is_this_ranks_share_of_the_logged_step_loss(run: WorkerRun) -> None:
    # logging_steps=1: the Trainer logs the mean over ranks of each rank's step loss.
    logged = by_step(run.result(0)["trainer_losses"])
    ours = [by_step(run.result(rank)["ddpmon_losses"]) for rank in (0, 1)]
    assert set(logged) == set(range(STEPS))
    for step in range(STEPS):
        mean = (ours[0][step] + ours[1][step]) / 2
        assert close(mean, logged[step], 1e-5), (step, ours[0][step], ours[1][step], logged[step])


def test_nan_in_one_ranks_gradient_is_named_with_that_rank(run: WorkerRun) -> None:
    check_nan_origin(run, NAN_RANK, NAN_STEP, NAN_PARAM)


def test_checkpoint_saves_are_recorded_with_their_step(run: WorkerRun) -> None:
    # save_steps=2 over 6 steps: checkpoint-2, -4, -6; every rank reaches on_save.
    for rank in (0, 1):
        assert run.sample(rank, "ddpmon_checkpoint_last_step") == STEPS
        assert run.sample(rank, "ddpmon_checkpoint_duration_seconds_count", kind="save") == 3
    saves = [e for e in run.events(0) if e.get("kind") == "checkpoint_save"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    assert all(e["path"].endswith(f"checkpoint-{e['step']}") for e in saves)


def test_wrong_reported_norm_fires_the_mismatch_counter_and_event(run: WorkerRun) -> None:
    check_mismatch(run, WRONG_STEP, NAN_STEP)


RESUME_AT = 4  # save_steps=2: checkpoint-4


@pytest.fixture(scope="module")
def resumed(run: WorkerRun, tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    """``train(resume_from_checkpoint=True)`` in a new launch up to 6, in an output dir that
    holds the full checkpoint-4 of the run above (its wrong report at step 2 is only logged,
    its NaN comes at step 5): the Trainer picks checkpoint-4."""
    hf = tmp_path_factory.mktemp("hf-output")
    shutil.copytree(run.out / "hf" / f"checkpoint-{RESUME_AT}", hf / f"checkpoint-{RESUME_AT}")
    assert (hf / f"checkpoint-{RESUME_AT}" / "optimizer.pt").exists()
    base = ["--accumulate", str(ACCUMULATE), "--wrong-step", "-1", "--nan-step", "-1",
            "--hf-dir", str(hf), "--full-checkpoints"]
    second = tmp_path_factory.mktemp("hf-resumed")
    cmd = torchrun(WORKER, "--out", str(second), "--port", str(free_port_pair()),
                   "--steps", str(STEPS), "--resume", *base)
    result = run_worker(cmd, second, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    return result


def test_a_resume_numbers_steps_as_the_trainer_does(resumed: WorkerRun) -> None:
    """The Trainer restores its global step before ``on_train_begin``: ddpmon counts from the
    checkpoint's step (4, 5), not from 0, and its norms equal the logged ones for those steps."""
    restored = {"model", "optimizer", "rng", "data_loader"}
    recovery = check_resume(resumed, RESUME_AT, STEPS, restored)
    assert recovery["path"].endswith(f"checkpoint-{RESUME_AT}"), recovery


def test_rerun_needs_no_change_to_a_trainer(tmp_path: Path) -> None:
    """``DdpmonCallback(on_nonfinite="rerun")`` on 2 DDP ranks, 2 micro-batches a step: the
    Trainer steps without a closure, yet its recorded ``training_step`` calls are rerun on both
    ranks. A one-off NaN on rank 1 at step 2 is transient (step skipped, training goes on); a
    NaN in every backward of rank 0 at step 4 reproduces, and ``trainer.train()`` raises
    ddpmon's error on both ranks at that step, before anything is applied."""
    worker = Path(__file__).with_name("transformers_rerun_worker.py")
    cmd = torchrun(worker, "--out", str(tmp_path), "--port", str(free_port_pair()))
    result = run_worker(cmd, tmp_path, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    for rank in (0, 1):
        res = result.result(rank)
        # each step 2 backward passes; steps 2 and 4 twice that (the rerun)
        assert res["backwards"] == {"0": 2, "1": 2, "2": 4, "3": 2, "4": 4}, res
        assert res["global_step"] == 4 and res["finite"], res
        assert res["error"]["type"] == "NonFiniteGradientError", res
        assert "step 4" in res["error"]["message"], res["error"]
        assert ("rank 0 is the origin" in res["error"]["message"]) is (rank == 0), res["error"]
        transient, deterministic = res["reruns"]
        assert (transient["step"], transient["fault"], transient["action"]) == (
            2, "transient", "skip"), transient
        assert transient["origin"] is (rank == 1), transient
        assert transient["param"] == (NAN_PARAM if rank == 1 else None), transient
        assert (deterministic["step"], deterministic["fault"], deterministic["action"]) == (
            4, "deterministic", "raise"), deterministic
        assert deterministic["origin"] is (rank == 0), deterministic
