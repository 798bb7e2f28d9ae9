"""FLOPs per step under DDP, FSDP2 and TP (2 gloo ranks): ``mon.count_flops``, and the automatic
count of a plain loop's third step (``flops_count_step=2``), equal, within
2 %, ``FlopCounterMode``'s own count of the same step on a plain copy of the model, each
tensor-parallel module at this rank's share, for a dense transformer layer, GQA + sliding-window
attention and a top-1 MoE. Under TP the unscaled count (the whole model's) would be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_flops_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(WORKER, tmp_path_factory.mktemp("flops"), timeout=300)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "tp"])
@pytest.mark.parametrize("kind", ["dense", "gqa_swa", "moe"])
def test_each_rank_counts_its_own_flops(results, strategy, kind):
    for rank in results:
        r = rank[f"{strategy}:{kind}"]
        assert r["expected"] > 0
        assert r["counted"] == pytest.approx(r["expected"], rel=0.02), r
        assert r["auto"] == pytest.approx(r["expected"], rel=0.02), r
        if strategy == "tp":  # each rank does its share, not the whole model
            assert r["counted"] < 0.9 * r["unsharded"], r
        else:
            assert r["counted"] == pytest.approx(r["unsharded"], rel=0.02), r
