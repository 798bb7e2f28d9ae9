"""DeepSpeed extras on 2 real gloo ranks (``_deepspeed_extras_worker.py``, one launch):

- ``on_loss_scale_floor`` with both scalers: a GradScaler under DDP and DeepSpeed's own
  DynamicLossScaler in a real fp16 ZeRO-2 engine (``DS_ACCELERATOR=cpu``, past DeepSpeed's CPU
  fp16 check as in test_deepspeed.py). Rank 1's local gradient overflows every step from
  ``INF_FROM`` on; every expected step is derived from the scales the scalers reported.
- the Lightning callback finds the engine of a DeepSpeedStrategy (a stand-in trainer: Lightning
  refuses that strategy on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ddpmon.forensics.timeline import build_timeline  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

from . import _deepspeed_extras_worker as W  # noqa: E402

MIN_SCALE_TEXT = "Current loss scale already at minimum"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("deepspeed-extras")
    return run_ranks(
        Path(W.__file__), out, [], timeout=240,
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )


def run(runs, rank: int, name: str) -> dict:
    res = runs[rank][name]
    assert "error" not in res, res.get("error")
    return res


def kth_step_at_floor(scales: list[float], floor: float, k: int) -> int:
    """The step whose scale after it is the k-th consecutive one at or below ``floor``."""
    streak = 0
    for step, scale in enumerate(scales):
        streak = streak + 1 if scale <= floor else 0
        if streak == k:
            return step
    raise AssertionError(f"never {k} steps at or below {floor}: {scales}")


def floor_events(res: dict, rank: int) -> list[dict]:
    path = Path(res["run_path"]) / f"events.rank{rank}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e["kind"] == "loss_scale_floor"]


@pytest.mark.parametrize("name", ["gs-raise", "ds-raise"])
def test_raise_stops_every_rank_at_the_same_step_with_one_message(runs, name):
    results = [run(runs, rank, name) for rank in (0, 1)]
    assert results[0]["scales"] == results[1]["scales"]  # the shared scale the rule relies on
    expected = kth_step_at_floor(results[0]["scales"], W.FLOOR, W.K)
    messages = set()
    for rank, res in enumerate(results):
        err = res["raised"]
        assert err["type"] == "LossScaleFloorError"
        assert err["at"] == err["step"] == expected  # raised by the call ending that step
        assert err["loss_scale"] == res["scales"][expected] <= W.FLOOR
        assert err["origin_ranks"] == [W.INF_RANK]
        assert err["checkpoint"]["step"] == W.CKPT_STEP + 1
        messages.add(err["message"])
        (event,) = floor_events(res, rank)
        assert event["action"] == "raise" and event["source"] == "ddpmon"
        assert event["step"] == expected and event["message"] == err["message"]
        assert event["origin_ranks"] == [W.INF_RANK]
        assert bool(event["origin_steps"]) is (rank == W.INF_RANK)
    (message,) = messages
    assert f"at step {expected}" in message
    assert f"loss scale {results[0]['scales'][expected]:g}" in message
    assert f"overflow origin ranks: [{W.INF_RANK}]" in message
    # each rank saved its own file at the same step: the message names rank 0's
    assert f"last good checkpoint: step {W.CKPT_STEP + 1} at {results[0]['ckpt']}" in message
    first = build_timeline(results[0]["run_path"]).first_failure
    assert first["kind"] == "loss_scale_floor" and first["step"] == expected
    assert first["class"] == "origin"


def test_deepspeed_scales_are_deepspeeds_own(runs):
    for rank in (0, 1):
        res = run(runs, rank, "ds-raise")
        assert res["scaler"] == "DynamicLossScaler"
        # every overflow halved DeepSpeed's scale; skipped steps counted by the engine
        assert res["skipped_steps"] == sum(
            1 for a, b in zip(res["scales"], res["scales"][1:], strict=False) if b < a
        )


def test_record_keeps_training_and_records_once(runs):
    for rank in (0, 1):
        res = run(runs, rank, "gs-record")
        assert res["raised"] is None and res["steps_done"] == W.STEPS
        expected = kth_step_at_floor(res["scales"], W.FLOOR, W.K)
        (event,) = floor_events(res, rank)  # once per episode, though the scale stays low
        assert event["action"] == "record" and event["step"] == expected
        assert event["loss_scale"] == res["scales"][expected]
        assert event["checkpoint"]["step"] == W.CKPT_STEP + 1


def test_deepspeed_min_scale_raise_is_chained(runs):
    steps = set()
    for rank in (0, 1):
        res = run(runs, rank, "ds-min-raise")
        err = res["raised"]
        assert err["type"] == "LossScaleFloorError" and err["cause"] == "Exception"
        assert MIN_SCALE_TEXT in err["cause_message"]
        assert "DeepSpeed's loss scale reached its minimum" in err["message"]
        (event,) = floor_events(res, rank)
        assert event["source"] == "deepspeed" and event["action"] == "raise"
        steps.add(err["step"])
    assert len(steps) == 1
    assert len({run(runs, r, "ds-min-raise")["raised"]["message"] for r in (0, 1)}) == 1


def test_deepspeed_record_keeps_training_until_deepspeeds_own_exception(runs):
    """record: ddpmon's rule records at the K-th step and training goes on; DeepSpeed's own
    exception at its minimum scale then propagates unchanged, recorded first."""
    for rank in (0, 1):
        res = run(runs, rank, "ds-record")
        err = res["raised"]
        assert err["type"] == "Exception" and MIN_SCALE_TEXT in err["message"]
        expected = kth_step_at_floor(res["scales"], W.FLOOR, W.K)
        assert expected < err["at"]  # training went on past ddpmon's decision
        ours, theirs = floor_events(res, rank)
        assert (ours["source"], ours["action"], ours["step"]) == ("ddpmon", "record", expected)
        assert theirs["source"] == "deepspeed" and theirs["action"] == "record"
        assert theirs["step"] == err["at"] and MIN_SCALE_TEXT in theirs["message"]


def test_a_rank_whose_own_facts_fail_still_joins_and_raises_alike(runs):
    """Rank 1 cannot derive its own facts at the decision step: it still joins the gather, both
    ranks raise at the same step with one message that says whose facts are missing."""
    results = [run(runs, rank, "gs-raise-fail") for rank in (0, 1)]
    expected = kth_step_at_floor(results[0]["scales"], W.FLOOR, W.K)
    assert {r["raised"]["step"] for r in results} == {expected}
    (message,) = {r["raised"]["message"] for r in results}
    assert f"facts missing from rank(s) {W.INF_RANK}" in message
    assert results[W.INF_RANK]["errors"] == {"floor": 1}
    assert results[1 - W.INF_RANK]["errors"] == {}


def test_lightning_callback_attaches_to_the_deepspeed_engine(runs):
    for rank in (0, 1):
        res = run(runs, rank, "lightning")
        assert res["attached"], res["monitor_error"]
        assert res["strategy"] == "deepspeed-zero2"
        assert res["steps"] == res["global_steps"] == len(res["theirs"])
        for ours, theirs in zip(res["ours"], res["theirs"], strict=True):
            assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
