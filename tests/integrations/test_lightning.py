"""DdpmonCallback in a real 2-rank Lightning DDP run on CPU (gloo), one run per precision.

Each run: 6 optimizer steps; the module logs its global gradient norm every step, scaled by 1.5
at step 2 (a wrong reported norm); rank 1 gets a NaN in one local gradient at step 5.
The bf16 run uses the ``pytorch_lightning`` package, accumulates 2 micro-batches per step and
logs the norm every other step only.
"""

from __future__ import annotations

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
    python,
    run_worker,
)
from tests.support.ports import free_port_pair

WORKER = Path(__file__).with_name("lightning_worker.py")
STEPS, WRONG_STEP, NAN_STEP, NAN_RANK, NAN_PARAM = 6, 2, 5, 1, "net.0.weight"
RUNS = {
    "32-true": ["--package", "lightning.pytorch"],
    # pytorch_lightning package, 2 micro-batches per step, the norm logged every other step
    "bf16-mixed": ["--package", "pytorch_lightning", "--accumulate", "2", "--log-every", "2"],
    # fp16 autocast + GradScaler on CPU; the norm under the name Lightning's grad_norm() gives it
    "16-mixed": ["--package", "lightning.pytorch", "--log-key", "grad_2.0_norm_total"],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory):
    """precision -> its run, launched once per module (the resume starts from one's checkpoint)."""
    done: dict[str, WorkerRun] = {}

    def get(precision: str) -> WorkerRun:
        if precision not in done:
            out = tmp_path_factory.mktemp(f"lightning-{precision}")
            cmd = [python(), str(WORKER), "--out", str(out), "--precision", precision]
            cmd += ["--port", str(free_port_pair()), "--steps", str(STEPS)]
            cmd += ["--wrong-step", str(WRONG_STEP), "--nan-step", str(NAN_STEP)]
            cmd += ["--nan-rank", str(NAN_RANK), *RUNS[precision]]
            result = run_worker(cmd, out, timeout=240)
            assert result.rc == 0, result.output[-4000:]
            result.label = precision
            done[precision] = result
        return done[precision]

    return get


@pytest.fixture(scope="module", params=list(RUNS))
def run(request: pytest.FixtureRequest, launched) -> WorkerRun:
    return launched(request.param)


def test_attaches_to_the_wrapped_model_and_the_plugin_scaler(run: WorkerRun) -> None:
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["http_ok"] is True, f"/metrics did not answer during training: {res['http_ok']}"
        assert res["scaler"] == ("GradScaler" if run.label == "16-mixed" else "NoneType")
        # The DDP comm hook saw the all-reduces: ddpmon attached to the strategy's DDP wrapper.
        assert (run.sample(rank, "ddpmon_collective_bytes_total", op="all_reduce") or 0) > 0


def test_the_backend_is_the_one_lightning_set_up(run: WorkerRun) -> None:
    assert run.manifest()["topology"]["backend"] == "gloo"


def test_steps_equal_the_trainers_global_steps(run: WorkerRun) -> None:
    check_steps(run, STEPS)


def test_grad_norm_equals_the_logged_norm(run: WorkerRun) -> None:
    check_norms(run, range(NAN_STEP))


def test_loss_is_the_training_step_loss(run: WorkerRun) -> None:
    for rank in (0, 1):
        res = run.result(rank)
        logged, ours = by_step(res["trainer_losses"]), by_step(res["ddpmon_losses"])
        assert set(ours) == set(range(STEPS))
        for step in range(STEPS):
            assert close(ours[step], logged[step], 1e-6), (rank, step, ours[step], logged[step])


def test_nan_in_one_ranks_gradient_is_named_with_that_rank(run: WorkerRun) -> None:
    check_nan_origin(run, NAN_RANK, NAN_STEP, NAN_PARAM)


def test_checkpoint_saves_are_timed_on_the_rank_that_writes(run: WorkerRun) -> None:
    # ModelCheckpoint(every_n_train_steps=2) saves at global steps 2, 4, 6 on rank 0 only.
    assert run.sample(0, "ddpmon_checkpoint_last_step") == STEPS
    assert run.sample(0, "ddpmon_checkpoint_duration_seconds_count", kind="save") == STEPS // 2
    assert run.sample(1, "ddpmon_checkpoint_duration_seconds_count", kind="save") in (None, 0)


def test_wrong_reported_norm_fires_the_mismatch_counter_and_event(run: WorkerRun) -> None:
    check_mismatch(run, WRONG_STEP, NAN_STEP)


RESUME_AT = 4  # ModelCheckpoint(every_n_train_steps=2) writes a checkpoint at global step 4


@pytest.fixture(scope="module")
def resumed(launched, tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    """``fit(ckpt_path=<step 4>)`` in a new process up to 6, from the checkpoint the 32-true run
    wrote at step 4 (its wrong report at step 2 is only logged; its NaN comes at step 5)."""
    first = launched("32-true").out
    (ckpt,) = (first / "ckpt").glob(f"*step={RESUME_AT}.ckpt")
    base = [python(), str(WORKER), "--precision", "32-true", *RUNS["32-true"]]
    base += ["--wrong-step", "-1", "--nan-step", "-1"]
    second = tmp_path_factory.mktemp("lightning-resumed")
    result = run_worker([*base, "--out", str(second), "--port", str(free_port_pair()),
                         "--steps", str(STEPS), "--resume", str(ckpt)], second, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    return result


def test_a_resume_numbers_steps_as_the_trainer_does(resumed: WorkerRun) -> None:
    """Lightning restores its global step before the callback attaches: ddpmon counts from the
    checkpoint's step (4, 5), not from 0, and its norms are the trainer's for those steps."""
    check_resume(resumed, RESUME_AT, STEPS, {"model", "optimizer", "data_loader"})
    for rank in (0, 1):  # the module's own norms: only the resumed steps ran here
        assert sorted(by_step(resumed.result(rank)["true_norms"])) == list(range(RESUME_AT, STEPS))


def test_rerun_needs_no_change_to_a_lightning_module(tmp_path: Path) -> None:
    """``DdpmonCallback(on_nonfinite="rerun")``: Lightning's own optimizer closure is rerun on
    both ranks; the one-off NaN on rank 1 is transient, its step skipped, training goes on."""
    worker = Path(__file__).with_name("lightning_rerun_worker.py")
    cmd = [python(), str(worker), "--out", str(tmp_path), "--port", str(free_port_pair()),
           "--steps", "6", "--nan-step", "3", "--nan-rank", "1"]
    result = run_worker(cmd, tmp_path, timeout=240)
    assert result.rc == 0, result.output[-4000:]
    for rank in (0, 1):
        res = result.result(rank)
        assert res["global_step"] == 6 and res["finite"], res
        assert res["backwards"] == {"0": 1, "1": 1, "2": 1, "3": 2, "4": 1, "5": 1}, res
        (rerun,) = res["reruns"]
        assert (rerun["step"], rerun["fault"], rerun["action"]) == (3, "transient", "skip")
        assert rerun["origin"] is (rank == 1), rerun

