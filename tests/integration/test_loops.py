"""Training loops as real scripts write them, on two real gloo ranks: the numbers ddpmon reports
equal what the user's own tools report, step for step, and steps are counted as the optimizer
counts them."""

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("loops_worker.py")


def run(
    tmp_path: Path, scenario: str, steps: int = 12, at: int = 4, world: int = 2, fsdp=False
) -> list:
    args = ["--scenario", scenario, "--steps", str(steps), "--at", str(at)]
    return run_ranks(WORKER, tmp_path, [*args, *(["--fsdp"] if fsdp else [])], world=world)


def assert_norms_match(result: dict, steps: int) -> None:
    entries = result["steps"]
    assert len(entries) == steps
    for e in entries:
        assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e


def test_gradient_accumulation_counts_optimizer_steps_and_matches_torch(tmp_path):
    for r in run(tmp_path, "accum", steps=8):
        assert r["steps_total"] == 8  # 16 micro-steps, 8 optimizer steps
        assert r["strategy"] == "ddp"
        assert_norms_match(r, 8)


def test_nan_applied_by_the_optimizer_has_one_origin_rank_and_step(tmp_path):
    # fp32, no GradScaler, record mode: rank 1's gradient turns NaN at step 5 and SGD applies it;
    # every later step is NaN on every rank because the weights are.
    r0, r1 = run(tmp_path, "propagate", steps=16, at=5)
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    assert r1["first_nonfinite"] == {"step": 5, "param": "layers.1.weight"}
    assert r0["first_nonfinite"] is None
    for r in (r0, r1):
        assert r["nonfinite_steps"] == 11  # steps 5..15
        assert r["steps_total"] == 16
    assert r1["poisoned_steps"] == 10 and r0["poisoned_steps"] >= 9  # rank 0's step 5 was finite


def test_guard_and_skip_loop_counts_the_skipped_step_and_its_nan_loss(tmp_path):
    r0, r1 = run(tmp_path, "guard", steps=12, at=4)
    for r in (r0, r1):
        assert r["steps_total"] == 12  # the step the loop skipped is still a step
        assert r["nonfinite_steps"] == 1
        assert r["poisoned_steps"] == 0  # the NaN never reached the weights
        finite = [e for e in r["steps"] if e["step"] != 4]
        for e in finite:
            assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["loss_nonfinite"] == 1 and r0["loss_nonfinite"] == 0
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    assert r1["first_nonfinite"]["step"] == 4


def test_one_rank_overflowing_every_step_keeps_the_collectives_in_step(tmp_path):
    # Only rank 1's local norms are inf from step 3; the duplicated-data check's all-gather
    # (every 3 steps) must keep one layout on both ranks. The GradScaler absorbs every overflow.
    r0, r1 = run(tmp_path, "inf_one_rank", steps=12, at=3)
    for r in (r0, r1):
        assert r["steps_total"] == 12 and r["skipped"] == 9
        assert r["agent_errors"] == {}
        for e in r["steps"][:3]:  # unscaled, pre-clip, as torch reports after unscale_
            assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["origin_steps"] == 9 and r0["origin_steps"] == 0
    assert r0["poisoned_steps"] == r1["poisoned_steps"] == 0  # never applied


def test_closure_step_is_analysed_with_the_closures_gradients(tmp_path):
    (r,) = run(tmp_path, "closure_plain", steps=10, world=1)
    assert r["steps_total"] == 10
    assert_norms_match(r, 10)


def test_plain_model_reports_the_norm_before_the_users_clip(tmp_path):
    (r,) = run(tmp_path, "clip_plain", steps=8, world=1)
    assert_norms_match(r, 8)
    for e in r["steps"]:
        assert e["clip_returned"] == pytest.approx(e["ddpmon"], rel=1e-5)
        assert e["ddpmon"] > 0.01  # the pre-clip norm, not max_norm


def test_torch_compile_ddp_keeps_working(tmp_path):
    for r in run(tmp_path, "compile", steps=6):
        assert r["steps_total"] == 6
        assert r["agent_errors"] == {}
        assert_norms_match(r, 6)


def test_healthy_run_is_quiet_apart_from_the_start_line(tmp_path):
    results = run(tmp_path, "quiet", steps=12)
    for rank, r in enumerate(results):
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1, r["stderr"]
        assert lines[0].startswith(f"ddpmon: rank {rank} serves")
        assert r["agent_errors"] == {}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_on_nonfinite_skip_decides_alike_on_every_rank(tmp_path, fsdp):
    # rank 1's batch holds a NaN at step 4; the policy drops the step on both ranks alike,
    # so the weights stay finite and the run goes on.
    r0, r1 = run(tmp_path, "skip_policy", steps=8, at=4, fsdp=fsdp)
    for r in (r0, r1):
        assert r["params_finite"], r
        assert r["steps_total"] == 8 and r["nonfinite_steps"] == 1 and r["poisoned_steps"] == 0
        assert r["strategy"] == ("fsdp2" if fsdp else "ddp")
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0


def test_fsdp2_guard_and_skip_loop_and_accumulation(tmp_path):
    r0, r1 = run(tmp_path, "guard", steps=8, at=4, fsdp=True)
    for r in (r0, r1):
        assert r["steps_total"] == 8 and r["nonfinite_steps"] == 1 and r["poisoned_steps"] == 0
        for e in r["steps"]:
            if e["step"] != 4:
                assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    for r in run(tmp_path / "accum", "accum", steps=6, fsdp=True):
        assert r["steps_total"] == 6
        assert_norms_match(r, 6)
