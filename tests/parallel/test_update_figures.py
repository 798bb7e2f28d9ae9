"""Per-group weight norm, update norm, update/weight ratio and Adam moment norms under DDP,
FSDP2 and tensor parallel on 2 gloo ranks, HSDP and FSDP2+TP on a 2 x 2 mesh of 4
(tests/parallel/_updates_worker.py), DeepSpeed ZeRO 1-3 on 2 ranks (_updates_ds_worker.py) and
two pipeline stages on 2 ranks (_updates_pp_worker.py): equal, within 1e-6 relative, to a
reference computed from the full tensors (DeepSpeed: its full fp32 master weights and moments)
before and after each sampled step; sampled every ``update_every`` steps only, the same on every
rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel._updates_worker import EVERY, MESH_STRATEGIES, STEPS, STRATEGIES
from tests.support.ranks import run_ranks
from tests.support.updates import relative_errors

WORKER = Path(__file__).with_name("_updates_worker.py")
DS_WORKER = Path(__file__).with_name("_updates_ds_worker.py")
PP_WORKER = Path(__file__).with_name("_updates_pp_worker.py")
ZERO_STAGES = ("zero1", "zero2", "zero3")


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
        assert rank[strategy]["strategy"] == strategy
        assert_equal_to_reference(rank[strategy], strategy)
    assert_same_on_every_rank(ranks, strategy)


def assert_equal_to_reference(result: dict, strategy: str, prefix: str = "") -> None:
    """Every sampled step (and only those) equals the reference, group by group; ``prefix``:
    ddpmon's group names carry the pipeline stage (``stage0.emb``), the reference's do not."""
    assert not result["errors"]
    measured = {int(step): stats for step, stats in result["measured"].items()}
    assert sorted(measured) == list(range(0, STEPS, EVERY))
    for step, stats in measured.items():
        reference = {prefix + group: figures
                     for group, figures in result["reference"][step].items()}
        assert set(stats) == set(reference)  # every group, nothing else
        for group, key, error in relative_errors(stats, reference):
            assert error < 1e-6, (strategy, step, group, key, error)
        for figures in stats.values():  # AdamW keeps both moments
            assert figures["exp_avg_norm"] > 0 and figures["exp_avg_sq_norm"] > 0
            assert figures["update_norm"] > 0


def assert_same_on_every_rank(ranks: list[dict], strategy: str) -> None:
    """The figures are of the whole model: every rank reports the same."""
    first = ranks[0][strategy]["measured"]
    for other in (r[strategy]["measured"] for r in ranks[1:]):
        for step in first:
            for group in first[step]:
                for key, value in first[step][group].items():
                    assert other[step][group][key] == pytest.approx(value, rel=1e-9)


@pytest.fixture(scope="module")
def zero_ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("updates-ds")
    return run_ranks(DS_WORKER, out, timeout=240,
                     env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_deepspeed_figures_equal_the_full_fp32_reference(zero_ranks, stage):
    """ZeRO 1/2 step disjoint slices of flat fp32 partitions, ZeRO-3 partitions every
    parameter: each rank's squares are summed over the data-parallel group, nothing gathered."""
    for rank in zero_ranks:
        assert rank[stage]["strategy"] == f"deepspeed-{stage}"
        assert_equal_to_reference(rank[stage], stage)
    assert_same_on_every_rank(zero_ranks, stage)


def test_pipeline_stages_report_the_groups_they_hold(tmp_path):
    """Each stage measures its own groups (no collective): stage 0 the embedding and the
    block, stage 1 the head, each equal to its stage's reference."""
    ranks = run_ranks(PP_WORKER, tmp_path)
    for rank in ranks:
        assert_equal_to_reference(rank["pp"], "pp", prefix=f"stage{rank['rank']}.")
    groups = [set(next(iter(rank["pp"]["measured"].values()))) for rank in ranks]
    assert groups == [{"stage0.emb", "stage0.block"}, {"stage1.head"}]
