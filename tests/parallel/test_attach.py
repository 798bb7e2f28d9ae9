"""``ddpmon.attach`` on FSDP2 (and TP) models, 2 real gloo ranks, scraped over HTTP after every
step: the exported norm is torch's pre-clip norm, ``ddpmon.clip_grad_norm_`` agrees with torch,
accumulation counts optimizer steps, and a NaN on one rank is an origin on that rank only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.parallel._attach_worker import AFTER, NAN_AT, SCALER_STEPS
from tests.parallel._worker import NAN_PARAM, NAN_RANK
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_attach_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("attach_fsdp2")
    results = run_ranks(WORKER, out)
    for rank in results:
        rank["metrics"] = (out / f"rank{rank['rank']}.metrics").read_text()
    return results


def _metric(text: str, name: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out.append((labels, float(value)))
    return out


def test_exported_norm_is_pre_clip_and_clip_agrees(run):
    for rank in run:
        clean = [s for s in rank["steps"] if s["step"] < NAN_AT]
        assert len(clean) == NAN_AT
        for s in clean:
            assert s["reference"] > 0.1  # the clip to 0.05 really changed the gradients
            assert math.isclose(s["grad_norm"], s["reference"], rel_tol=1e-5), s
            assert math.isclose(s["clip_returned"], s["reference"], rel_tol=1e-5), s


def test_local_norm_is_per_rank_and_steps_are_optimizer_steps(run):
    first = [rank["steps"][0]["grad_local_norm"] for rank in run]
    assert all(v is not None and v > 0 for v in first)
    assert first[0] != first[1]
    for rank in run:
        assert [s["steps_total"] for s in rank["steps"]] == [
            float(i + 1) for i in range(NAN_AT + 1 + AFTER)
        ]


def test_nan_origin_names_rank_param_and_step(run):
    for rank in run:
        text = rank["metrics"]
        assert 'strategy="fsdp2"' in _metric(text, "ddpmon_rank_info")[0][0]
        origin = _metric(text, "ddpmon_grad_nonfinite_origin_steps_total")[0][1]
        assert origin == (1.0 if rank["rank"] == NAN_RANK else 0.0)
        assert _metric(text, "ddpmon_grad_nonfinite_steps_total")[0][1] == 1 + AFTER
        assert _metric(text, "ddpmon_grad_nonfinite_poisoned_steps_total")[0][1] == AFTER
        errors = [v for labels, v in _metric(text, "ddpmon_agent_errors_total")]
        assert errors and not any(errors)
        info = _metric(text, "ddpmon_grad_first_nonfinite_info")
        if rank["rank"] == NAN_RANK:
            assert len(info) == 1
            assert f'param="{NAN_PARAM}"' in info[0][0] and f'step="{NAN_AT}"' in info[0][0]
        else:
            assert info == []


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("attach_fsdp2_scaler")
    args = ("--scaler",)
    return run_ranks(WORKER, out, args)


def test_gradscaler_norms_are_unscaled_and_clip_reuses_them(scaled_run):
    """Loss scale 2**10: the exported norm and ``ddpmon.clip_grad_norm_`` (after ``unscale_``,
    answered from the step's reduction with the scale divided out) equal torch's unscaled norm."""
    for rank in scaled_run:
        assert len(rank["steps"]) == SCALER_STEPS
        for s in rank["steps"]:
            assert math.isclose(s["grad_norm"], s["reference"], rel_tol=1e-5), s
            assert math.isclose(s["clip_returned"], s["reference"], rel_tol=1e-5), s
            assert s["grad_local_norm"] is not None and s["grad_local_norm"] < 100
            assert s["clip_reused"] == s["step"] + 1


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("attach_tp")
    results = run_ranks(WORKER, out, ["--strategy", "tp"])
    for rank in results:
        rank["metrics"] = (out / f"rank{rank['rank']}.metrics").read_text()
    return results


def test_tensor_parallel_through_attach(tp_run):
    """TP (DTensor and plain parameters mixed): label ``tp``, exported norm equals torch's
    (per parameter, ``.full_tensor()``), the local norm (of this rank's shards) is not exported
    as a complete local norm."""
    for rank in tp_run:
        assert 'strategy="tp"' in _metric(rank["metrics"], "ddpmon_rank_info")[0][0]
        for s in rank["steps"]:
            assert math.isclose(s["grad_norm"], s["reference"], rel_tol=1e-5), s
            assert s["grad_local_norm"] is None
