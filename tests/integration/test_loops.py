"""Training loops as real scripts write them, on two real gloo ranks: the numbers ddpmon reports
equal what the user's own tools report, step for step, and steps are counted as the optimizer
counts them."""

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("loops_worker.py")

# Cases per launch: (id, scenario, steps, at, fsdp). Starting two ranks costs far more than a
# case's steps, so the cases share launches; each still gets a fresh model, optimizer, monitor
# and run id. "quiet" checks its process's whole stderr, so it runs alone.
LAUNCHES: dict[str, tuple[int, list[tuple[str, str, int, int, bool]]]] = {
    "two_ranks": (2, [
        ("accum", "accum", 8, 4, False),
        ("propagate", "propagate", 16, 5, False),
        ("guard", "guard", 12, 4, False),
        ("inf_one_rank", "inf_one_rank", 12, 3, False),
        ("skip_ddp", "skip_policy", 8, 4, False),
        ("skip_fsdp2", "skip_policy", 8, 4, True),
        ("guard_fsdp2", "guard", 8, 4, True),
        ("accum_fsdp2", "accum", 6, 4, True),
        ("compile", "compile", 6, 4, False),
    ]),
    "one_rank": (1, [
        ("closure_plain", "closure_plain", 10, 4, False),
        ("clip_plain", "clip_plain", 8, 4, False),
    ]),
    "quiet": (2, [("quiet", "quiet", 12, 4, False)]),
}
CASES = {case[0]: launch for launch, (_, cases) in LAUNCHES.items() for case in cases}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(case_id)``: every rank's result of that case; each launch runs once per module."""
    done: dict[str, list[dict]] = {}

    def get(case_id: str) -> list[dict]:
        launch = CASES[case_id]
        if launch not in done:
            world, cases = LAUNCHES[launch]
            args = []
            for cid, scenario, steps, at, fsdp in cases:
                args += ["--case", f"{cid}:{scenario}:{steps}:{at}" + (":fsdp" if fsdp else "")]
            done[launch] = run_ranks(WORKER, tmp_path_factory.mktemp(launch), args, world=world)
        return [{**rank[case_id], "stderr": rank["stderr"]} for rank in done[launch]]

    return get


def assert_norms_match(result: dict, steps: int) -> None:
    entries = result["steps"]
    assert len(entries) == steps
    for e in entries:
        assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e


def test_gradient_accumulation_counts_optimizer_steps_and_matches_torch(run):
    for r in run("accum"):
        assert r["steps_total"] == 8  # 16 micro-steps, 8 optimizer steps
        assert r["strategy"] == "ddp"
        assert_norms_match(r, 8)


def test_nan_applied_by_the_optimizer_has_one_origin_rank_and_step(run):
    # fp32, no GradScaler, record mode: rank 1's gradient turns NaN at step 5 and SGD applies it;
    # every later step is NaN on every rank because the weights are.
    r0, r1 = run("propagate")
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    assert r1["first_nonfinite"] == {"step": 5, "param": "layers.1.weight"}
    assert r0["first_nonfinite"] is None
    for r in (r0, r1):
        assert r["nonfinite_steps"] == 11  # steps 5..15
        assert r["steps_total"] == 16
    assert r1["poisoned_steps"] == 10 and r0["poisoned_steps"] >= 9  # rank 0's step 5 was finite


def test_guard_and_skip_loop_counts_the_skipped_step_and_its_nan_loss(run):
    r0, r1 = run("guard")
    for r in (r0, r1):
        assert r["steps_total"] == 12  # the step the loop skipped is still a step
        assert {k: v for k, v in r["steps_skipped"].items() if v} == {"loop": 1}
        assert r["nonfinite_steps"] == 1
        assert r["poisoned_steps"] == 0  # the NaN never reached the weights
        finite = [e for e in r["steps"] if e["step"] != 4]
        for e in finite:
            assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["loss_nonfinite"] == 1 and r0["loss_nonfinite"] == 0
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    assert r1["first_nonfinite"]["step"] == 4


def test_one_rank_overflowing_every_step_keeps_the_collectives_in_step(run):
    # Only rank 1's local norms are inf from step 3; the duplicated-data check's all-gather
    # (every 3 steps) must keep one layout on both ranks. The GradScaler absorbs every overflow.
    r0, r1 = run("inf_one_rank")
    for r in (r0, r1):
        assert r["steps_total"] == 12 and r["skipped"] == 9
        assert r["steps_skipped"] == {"loop": 0, "scaler": 9}
        assert r["agent_errors"] == {}
        for e in r["steps"][:3]:  # unscaled, pre-clip, as torch reports after unscale_
            assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["origin_steps"] == 9 and r0["origin_steps"] == 0
    assert r0["poisoned_steps"] == r1["poisoned_steps"] == 0  # never applied


def test_closure_step_is_analysed_with_the_closures_gradients(run):
    (r,) = run("closure_plain")
    assert r["steps_total"] == 10
    assert_norms_match(r, 10)


def test_plain_model_reports_the_norm_before_the_users_clip(run):
    (r,) = run("clip_plain")
    assert_norms_match(r, 8)
    for e in r["steps"]:
        assert e["clip_returned"] == pytest.approx(e["ddpmon"], rel=1e-5)
        assert e["ddpmon"] > 0.01  # the pre-clip norm, not max_norm


def test_torch_compile_ddp_keeps_working(run):
    for r in run("compile"):
        assert r["steps_total"] == 6
        assert r["agent_errors"] == {}
        assert_norms_match(r, 6)


def test_healthy_run_is_quiet_apart_from_the_start_line(run):
    results = run("quiet")
    for rank, r in enumerate(results):
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1, r["stderr"]
        assert lines[0].startswith(f"ddpmon: rank {rank} serves")
        assert r["agent_errors"] == {}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_on_nonfinite_skip_decides_alike_on_every_rank(run, fsdp):
    # rank 1's batch holds a NaN at step 4; the policy drops the step on both ranks alike,
    # so the weights stay finite and the run goes on.
    r0, r1 = run("skip_fsdp2" if fsdp else "skip_ddp")
    for r in (r0, r1):
        assert r["params_finite"], r
        assert r["steps_total"] == 8 and r["nonfinite_steps"] == 1 and r["poisoned_steps"] == 0
        assert r["steps_skipped"] == {"loop": 0, "policy": 1}, r["steps_skipped"]
        assert r["strategy"] == ("fsdp2" if fsdp else "ddp")
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0


def test_fsdp2_guard_and_skip_loop_and_accumulation(run):
    r0, r1 = run("guard_fsdp2")
    for r in (r0, r1):
        assert r["steps_total"] == 8 and r["nonfinite_steps"] == 1 and r["poisoned_steps"] == 0
        assert {k: v for k, v in r["steps_skipped"].items() if v} == {"loop": 1}
        for e in r["steps"]:
            if e["step"] != 4:
                assert e["ddpmon"] == pytest.approx(e["ref"], rel=1e-5), e
    assert r1["origin_steps"] == 1 and r0["origin_steps"] == 0
    for r in run("accum_fsdp2"):
        assert r["steps_total"] == 6
        assert_norms_match(r, 6)
