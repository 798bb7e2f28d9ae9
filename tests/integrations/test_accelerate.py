"""``ddpmon.attach(model, optimizer, accelerator=accelerator)`` on Accelerate's prepared objects:
torchrun, 2 gloo ranks on CPU, gradient accumulation over 2 micro-batches.

The loop hands ddpmon the norm ``accelerator.clip_grad_norm_`` returned (a tensor, during the
step), scaled by 1.5 at step 2; rank 1 gets a NaN in one local gradient at step 5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.integrations import (
    WorkerRun,
    check_mismatch,
    check_nan_origin,
    check_norms,
    check_steps,
    run_worker,
)
from tests.support.ports import free_port_pair
from tests.support.ranks import torchrun

WORKER = Path(__file__).with_name("accelerate_worker.py")
STEPS, ACCUMULATE, WRONG_STEP, NAN_STEP, NAN_RANK, NAN_PARAM = 6, 2, 2, 5, 1, "0.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    out = tmp_path_factory.mktemp("accelerate")
    cmd = torchrun(WORKER, "--out", str(out), "--port", str(free_port_pair()))
    cmd += ["--steps", str(STEPS), "--accumulate", str(ACCUMULATE)]
    cmd += ["--wrong-step", str(WRONG_STEP), "--nan-step", str(NAN_STEP)]
    cmd += ["--nan-rank", str(NAN_RANK)]
    result = run_worker(cmd, out, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    return result


def test_the_backend_is_the_one_accelerate_set_up(run: WorkerRun) -> None:
    assert run.manifest()["topology"]["backend"] == "gloo"


def test_counts_optimizer_steps_not_micro_batches(run: WorkerRun) -> None:
    check_steps(run, STEPS)
    assert run.result(0)["micro_batches"] == STEPS * ACCUMULATE


def test_grad_norm_equals_the_loops_clip_norm(run: WorkerRun) -> None:
    check_norms(run, range(NAN_STEP))
    # DDP comm hook in place
    assert (run.sample(0, "ddpmon_collective_bytes_total", op="all_reduce") or 0) > 0


def test_nan_in_one_ranks_gradient_is_named_with_that_rank(run: WorkerRun) -> None:
    check_nan_origin(run, NAN_RANK, NAN_STEP, NAN_PARAM)


def test_wrong_reported_norm_fires_the_mismatch_counter_and_event(run: WorkerRun) -> None:
    check_mismatch(run, WRONG_STEP, NAN_STEP)
