"""FLOPs per step under DDP, FSDP2 and TP (2 gloo ranks): ``mon.count_flops``, and the automatic
count of a plain loop's third step (``flops_count_step=2``), equal, within
2 %, ``FlopCounterMode``'s own count of the same step on a plain copy of the model, each
tensor-parallel module at this rank's share, for a dense transformer layer, GQA + sliding-window
attention and a top-1 MoE. Under TP the unscaled count (the whole model's) would be wrong.

Tokens/s per run: a language model on token ids under TP and as 2 pipeline stages (the second
stage reads activations, not ids); the sum of the ranks' tokens/s is the replica's true tokens/s
(its tokens per step at its ranks' steps/s), not twice it. Per stage, the automatic count equals
``FlopCounterMode``'s own count of that stage's step."""

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
        # the ranks that train on one batch: the TP ranks; each DDP/FSDP2 rank reads its own
        assert r["shared_by"] == (len(results) if strategy == "tp" else 1)
        if strategy == "tp":  # each rank does its share, not the whole model
            assert r["counted"] < 0.9 * r["unsharded"], r
        else:
            assert r["counted"] == pytest.approx(r["unsharded"], rel=0.02), r


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_the_runs_tokens_per_second_counts_each_batch_once(results, strategy):
    ranks = [rank[f"{strategy}:lm"] for rank in results]
    true_tokens = ranks[0]["true_tokens"]  # one replica: both ranks train on the same ids
    assert all(r["true_tokens"] == true_tokens for r in ranks)
    steps_per_second = sum(r["steps_per_second"] for r in ranks) / len(ranks)
    run = sum(r["tokens_per_second"] for r in ranks)
    assert run == pytest.approx(true_tokens * steps_per_second, rel=1e-9), ranks
    for r in ranks:  # each rank's share: the same half of the replica's tokens
        assert r["tokens_per_second"] / r["steps_per_second"] == pytest.approx(true_tokens / 2)


def test_each_pipeline_stage_counts_its_own_flops(results):
    stages = [rank["pp:lm"] for rank in results]
    for stage in stages:
        assert stage["expected"] > 0
        assert stage["auto"] == pytest.approx(stage["expected"], rel=0.02), stage
    assert stages[0]["auto"] != stages[1]["auto"]  # two stages, two different counts
    assert all(stage["shared_by"] == len(results) for stage in stages)


def test_fsdp2_with_tp_shares_each_batch_over_the_tp_dim_only(results):
    for rank in results:
        assert rank["fsdp2+tp:shared_by"] == ["fsdp2+tp", len(results)]
