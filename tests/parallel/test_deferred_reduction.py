"""The training thread does not wait for a late peer's share of ddpmon's norm all-reduce on CPU
(``on_nonfinite='record'``: the record thread finishes it); ``'skip'`` still reads the reduced
norms before the optimizer step. Real gloo ranks, FSDP2; see ``_deferred_worker.py``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.parallel._deferred_worker import LATE_STEP, STEPS
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_deferred_worker.py")


@pytest.mark.parametrize("policy, returns_first", [("record", True), ("skip", False)])
def test_late_peer_holds_the_training_thread_only_when_the_policy_reads(
    tmp_path, policy, returns_first
):
    ranks = run_ranks(WORKER, tmp_path, ["--policy", policy])
    late = next(r for r in ranks if r["rank"] == 1)
    # rank 1 held its share of the step-LATE_STEP reduction until rank 0's step returned
    assert late["peer_saw_return"] is returns_first
    if not returns_first:  # False must mean the hold timed out, not any other failure
        assert "timeout" in (late["hold_error"] or ""), late["hold_error"]
    for rank in ranks:
        assert rank["deferred_type"] == "FSDPSource"
        assert not any(rank["errors"].values()), rank["errors"]
        assert sorted(int(s) for s in rank["ours"]) == list(range(STEPS))
        for step, theirs in enumerate(rank["torch"]):
            ours = rank["ours"][str(step)]
            assert math.isclose(ours, theirs, rel_tol=1e-6), (rank["rank"], step, ours, theirs)
        assert rank["forced_waits"] == 0
    assert LATE_STEP < STEPS
