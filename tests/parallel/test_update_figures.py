"""Per-group weight norm, update norm, update/weight ratio and Adam moment norms under DDP,
FSDP2 and tensor parallel on 2 gloo ranks, HSDP and FSDP2+TP on a 2 x 2 mesh of 4
(tests/parallel/_updates_worker.py): equal, within
1e-6 relative, to a reference computed from the full tensors before and after each sampled
step; sampled every ``update_every`` steps only, the same on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel._updates_worker import EVERY, MESH_STRATEGIES, STEPS, STRATEGIES
from tests.support.ranks import run_ranks
from tests.support.updates import relative_errors

WORKER = Path(__file__).with_name("_updates_worker.py")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    done: dict[bool, list[dict]] = {}

    def get(mesh: bool) -> list[dict]:
        if mesh not in done:
            out = tmp_path_factory.mktemp("updates")
            done[mesh] = (run_ranks(WORKER, out, ["--mesh"], world=4) if mesh
                          else run_ranks(WORKER, out))
        return done[mesh]

    return get


@pytest.mark.parametrize("strategy", STRATEGIES + MESH_STRATEGIES)
def test_figures_equal_the_full_tensor_reference(launched, strategy):
    ranks = launched(strategy in MESH_STRATEGIES)
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
    first = ranks[0][strategy]["measured"]
    for other in (r[strategy]["measured"] for r in ranks[1:]):
        for step in first:
            for group in first[step]:
                for key, value in first[step][group].items():
                    assert other[step][group][key] == pytest.approx(value, rel=1e-9)
