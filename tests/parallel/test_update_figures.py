"""Per-group weight norm, update norm, update/weight ratio and Adam moment norms under DDP,
FSDP2 and tensor parallel on 2 gloo ranks (tests/parallel/_updates_worker.py): equal, within
1e-6 relative, to a reference computed from the full tensors before and after each sampled
step; sampled every ``update_every`` steps only, the same on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel._updates_worker import EVERY, STEPS, STRATEGIES
from tests.support.ranks import run_ranks
from tests.support.updates import relative_errors

WORKER = Path(__file__).with_name("_updates_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORKER, tmp_path_factory.mktemp("updates"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_figures_equal_the_full_tensor_reference(ranks, strategy):
    for rank in ranks:
        result = rank[strategy]
        assert result["strategy"] == strategy
        assert not result["errors"]
        measured = {int(step): stats for step, stats in result["measured"].items()}
        assert sorted(measured) == list(range(0, STEPS, EVERY))
        for step, stats in measured.items():
            reference = result["reference"][step]
            assert set(stats) == set(reference)  # every group, nothing else
            for group, key, error in relative_errors(stats, reference):
                assert error < 1e-6, (strategy, step, group, key, error)
            for figures in stats.values():  # AdamW keeps both moments
                assert figures["exp_avg_norm"] > 0 and figures["exp_avg_sq_norm"] > 0
    # the figures are of the whole model: every rank reports the same
    first, second = (r[strategy]["measured"] for r in ranks)
    for step in first:
        for group in first[step]:
            for key, value in first[step][group].items():
                assert second[step][group][key] == pytest.approx(value, rel=1e-9)
