"""``on_nonfinite='rerun'`` under HSDP on real gloo ranks (``_rerun_worker.py``): every rank
reruns a non-finite step together (FSDP2's all-gathers and reduce-scatters run again), a
one-off NaN is transient and names its rank, a batch that always fails is deterministic and
raises on every rank at that step. DDP on 4 ranks, through ``ddpmon demo`` with a real
Prometheus: tests/integration/test_hardware_or_numerics.py; world size 1:
tests/unit/test_rerun.py."""

from __future__ import annotations

from pathlib import Path

from tests.parallel._rerun_worker import BAD_RANK, BAD_STEP, TRANSIENT_RANK, TRANSIENT_STEP
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_rerun_worker.py")


def test_hsdp_reruns_together_and_tells_transient_from_deterministic(tmp_path):
    ranks = run_ranks(WORKER, tmp_path, [], world=4)
    for r in ranks:
        assert r["errors"] == {}, r
        assert r["calls"][str(TRANSIENT_STEP)] == 2 and r["calls"][str(BAD_STEP)] == 2, r
        assert r["steps"] == BAD_STEP and r["finite"], r  # the bad step was never applied
        assert "reproduced on a rerun" in r["error"], r
        transient, deterministic = r["reruns"]
        assert (transient["step"], transient["fault"], transient["action"]) == (
            TRANSIENT_STEP, "transient", "skip")
        assert transient["origin"] is (r["rank"] == TRANSIENT_RANK), transient
        assert (deterministic["step"], deterministic["fault"], deterministic["action"]) == (
            BAD_STEP, "deterministic", "raise")
        assert deterministic["origin"] is (r["rank"] == BAD_RANK), deterministic
    bad = ranks[BAD_RANK]
    ids = [BAD_STEP * 100 + BAD_RANK * 4 + i for i in range(4)]
    assert bad["reruns"][1]["sample_ids"] == ids
    assert f"rank {BAD_RANK} is the origin" in bad["error"]
    assert "another rank is the origin" in ranks[0]["error"]


def test_deepspeed_zero2_reruns_a_handed_over_step(tmp_path):
    """ZeRO-2, fp32, 2 ranks: the loop hands each step to ``mon.run_step(closure)``. The
    one-off NaN on rank 1 is transient: both ranks reran it, and DeepSpeed stepped with the
    rerun's reduction in place of the first run's, so the weights are bit-identical to a run
    without the fault (action ``replace``). The batch that always fails on rank 0 is
    deterministic and raises on both ranks before ``engine.step`` applies anything."""
    from tests.parallel import _engine_rerun_worker as w

    env = {"DS_ACCELERATOR": "cpu"}
    ranks = run_ranks(Path(w.__file__), tmp_path / "faulty", [], world=2, env=env)
    clean = run_ranks(Path(w.__file__), tmp_path / "clean", ["--no-transient"], world=2, env=env)
    for r, reference in zip(ranks, clean, strict=True):
        assert r["errors"] == {}, r
        assert r["calls"][str(w.TRANSIENT_STEP)] == 2 and r["calls"][str(w.BAD_STEP)] == 2, r
        assert r["calls"][str(w.TRANSIENT_STEP + 1)] == 1, r
        # steps 0-4 were applied (the transient one with the rerun's gradients); step 5 raised
        assert (r["global_steps"], r["skipped_steps"]) == (w.BAD_STEP, 0), r
        assert r["finite"] and r["weights"] == reference["weights"], r["rank"]
        assert "reproduced on a rerun" in r["error"], r
        transient, deterministic = r["reruns"]
        assert (transient["step"], transient["fault"], transient["action"]) == (
            w.TRANSIENT_STEP, "transient", "replace")
        assert transient["origin"] is (r["rank"] == w.TRANSIENT_RANK), transient
        assert (deterministic["step"], deterministic["fault"], deterministic["action"]) == (
            w.BAD_STEP, "deterministic", "raise")
        assert deterministic["origin"] is (r["rank"] == w.BAD_RANK), deterministic
    bad = ranks[w.BAD_RANK]
    assert bad["reruns"][1]["sample_ids"] == [w.BAD_STEP * 100 + w.BAD_RANK * 4 + i
                                              for i in range(4)]
    assert f"rank {w.BAD_RANK} is the origin" in bad["error"]
