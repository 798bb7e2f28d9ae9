"""The framework integrations, unchanged, on a run that uses DeepSpeed ZeRO-2 (2 gloo ranks on
CPU under torchrun, ``DS_ACCELERATOR=cpu``):

- the Transformers ``Trainer`` with a DeepSpeed config and ``DdpmonCallback``: the callback is
  handed the bare module and Accelerate's optimizer wrapper and must find the engine
  (``trainer.model_wrapped``);
- Accelerate with a ``DeepSpeedPlugin`` and ``attach(accelerator.unwrap_model(model), optimizer,
  accelerator=accelerator)``: the engine is found at
  ``accelerator.deepspeed_engine_wrapped.engine``.

Every number is compared with DeepSpeed's own as the framework reports it: the Trainer's logged
``grad_norm`` (``engine.get_global_grad_norm()``) and ``global_step``. Same workers, steps, wrong
report and NaN injection as test_transformers.py / test_accelerate.py.
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

pytest.importorskip("deepspeed")

HERE = Path(__file__).parent
STEPS, ACCUMULATE, WRONG_STEP, NAN_STEP, NAN_RANK = 6, 2, 2, 5, 1
HF_NAN_PARAM = "transformer.h.0.mlp.c_fc.weight"
ACC_NAN_PARAM = "0.weight"
ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}


def _launch(worker: str, out: Path, *extra: str) -> WorkerRun:
    cmd = torchrun(HERE / worker, "--out", str(out), "--port", str(free_port_pair()))
    cmd += ["--steps", str(STEPS), "--accumulate", str(ACCUMULATE)]
    cmd += ["--wrong-step", str(WRONG_STEP), "--nan-step", str(NAN_STEP)]
    cmd += ["--nan-rank", str(NAN_RANK), "--deepspeed-stage", "2", *extra]
    result = run_worker(cmd, out, timeout=240, extra_env=ENV)
    assert result.rc == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    return _launch("transformers_worker.py", tmp_path_factory.mktemp("hf-deepspeed"))


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    return _launch("accelerate_worker.py", tmp_path_factory.mktemp("acc-deepspeed"), "--unwrapped")


@pytest.mark.parametrize("fixture", ["trainer_run", "accelerate_run"])
def test_attaches_to_the_engine(request, fixture) -> None:
    run = request.getfixturevalue(fixture)
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["strategy"] == "deepspeed-zero2"


@pytest.mark.parametrize("fixture", ["trainer_run", "accelerate_run"])
def test_steps_equal_the_frameworks_global_step(request, fixture) -> None:
    check_steps(request.getfixturevalue(fixture), STEPS)


@pytest.mark.parametrize("fixture", ["trainer_run", "accelerate_run"])
def test_norm_equals_deepspeeds_as_the_framework_reports_it(request, fixture) -> None:
    check_norms(request.getfixturevalue(fixture), range(STEPS))  # the NaN step: non-finite on both


@pytest.mark.parametrize(
    ("fixture", "param"), [("trainer_run", HF_NAN_PARAM), ("accelerate_run", ACC_NAN_PARAM)]
)
def test_nan_named_with_its_rank_and_parameter(request, fixture, param) -> None:
    check_nan_origin(request.getfixturevalue(fixture), NAN_RANK, NAN_STEP, param)


@pytest.mark.parametrize("fixture", ["trainer_run", "accelerate_run"])
def test_wrong_reported_norm_is_a_mismatch(request, fixture) -> None:
    check_mismatch(request.getfixturevalue(fixture), WRONG_STEP, NAN_STEP)


def test_accelerate_engine_counts_the_same_steps(accelerate_run: WorkerRun) -> None:
    for rank in (0, 1):
        assert accelerate_run.result(rank)["engine_global_steps"] == STEPS
