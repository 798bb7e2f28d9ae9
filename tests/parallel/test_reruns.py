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
