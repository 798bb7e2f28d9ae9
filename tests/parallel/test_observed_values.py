"""A DTensor loss and norm on 2 gloo ranks (tests/parallel/_observed_worker.py): a Replicate one
is recorded as its value on every rank; a Partial loss over two ranks, whose full value would
need a collective, is dropped alone and counted under ``probe="loss"``, the rest of its step's
record (norms, the trainer's norm) kept, and the next step's Replicate loss recorded again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel._observed_worker import PARTIAL_STEP, STEPS
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_observed_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORKER, tmp_path_factory.mktemp("observed"))


def test_replicate_losses_are_recorded_and_a_partial_one_is_dropped_alone(ranks):
    for rank in ranks:
        steps = rank["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS))
        for step, record in enumerate(steps):
            # the rest of the record stays, the Partial step's too
            assert record["grad_norm"] == pytest.approx(rank["norms"][step], rel=1e-5)
            assert record["trainer_grad_norm"] == pytest.approx(rank["norms"][step], rel=1e-6)
            assert not record["grad_norm_mismatch"]
            if step == PARTIAL_STEP:
                assert record["loss"] is None
            else:
                assert record["loss"] == pytest.approx(rank["full_losses"][step], rel=1e-6)
        assert rank["errors"] == {"loss": 1}
    # a Replicate loss is the same full value on every rank
    losses = [[s["loss"] for s in r["steps"]] for r in ranks]
    assert losses[0] == losses[1]
