"""A DTensor loss and norm on 4 gloo ranks, a 2x2 mesh (tests/parallel/_observed_worker.py), one
placement per step, each step's full value taken by the harness with ``full_tensor()``:

- a Replicate loss is recorded as its full value on every rank;
- a linear ``Partial`` loss (``avg`` over dp with ``sum`` over tp; ``sum`` over tp on identical
  dp rows) is recorded on each rank as its share, and the mean of the shares, what ``ddpmon
  compare`` reads from the histories, is the full value;
- a one-element ``Shard`` loss is recorded on the ranks that hold it, and nowhere else;
- a ``Partial(max)`` loss and a norm's ``_NormPartial`` are dropped alone and counted under
  ``probe="loss"``; the rest of their step's record stays.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpmon.forensics.compare import load_run
from tests.parallel._observed_worker import CASES, DROPPED, SHARED
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_observed_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("observed")
    return out, run_ranks(WORKER, out, world=4)


def test_every_rank_keeps_every_step_and_drops_only_the_unreadable_values(run):
    _, ranks = run
    for rank in ranks:
        steps = rank["steps"]
        assert [s["step"] for s in steps] == list(range(len(CASES)))
        for step, record in enumerate(steps):
            assert record["grad_norm"] == pytest.approx(rank["norms"][step], rel=1e-5)
            assert not record["grad_norm_mismatch"]
            if CASES[step] == "norm_partial":
                assert record["trainer_grad_norm"] is None
            else:
                assert record["trainer_grad_norm"] == pytest.approx(rank["norms"][step],
                                                                    rel=1e-6)
        assert rank["errors"] == {"loss": len(DROPPED)}
        assert "full_tensor()" in rank["stderr"]


@pytest.mark.parametrize("case", CASES)
def test_each_loss_is_its_full_value_or_a_share_whose_mean_is(run, case):
    _, ranks = run
    step = CASES.index(case)
    full = ranks[0]["full_losses"][step]
    recorded = [r["steps"][step]["loss"] for r in ranks]
    if case in ("replicate", "norm_partial"):
        assert recorded == [pytest.approx(full, rel=1e-6)] * len(ranks)
    elif case in SHARED:
        assert sum(recorded) / len(recorded) == pytest.approx(full, rel=1e-6)
        if case == "avg_sum":  # an averaged loss's share is the rank's own loss, as under DDP
            assert recorded == pytest.approx([r["locals"][step] for r in ranks], rel=1e-6)
    elif case == "shard_one":
        held = [r["steps"][step]["loss"] for r in ranks if r["tp"] == 0]
        assert held == [pytest.approx(full)] * 2
        assert [r["steps"][step]["loss"] for r in ranks if r["tp"] != 0] == [None, None]
    elif case == "max":
        assert recorded == [None] * len(ranks)


def test_compare_reads_the_full_loss_from_the_shares(run):
    out, ranks = run
    numerics = load_run(out / "runs")
    loss = dict(zip(numerics.steps.tolist(), numerics.series["loss"].tolist(), strict=True))
    for case in ("replicate", "norm_partial", *SHARED):
        step = CASES.index(case)
        assert loss[step] == pytest.approx(ranks[0]["full_losses"][step], rel=1e-6)
