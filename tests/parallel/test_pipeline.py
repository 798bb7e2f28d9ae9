"""Pipeline parallel on real gloo ranks: ``ddpmon.attach(model_parts, opt, schedule=...)`` on
torch's GPipe, 1F1B and Interleaved1F1B (two stages on one rank), alone (2 ranks) and composed
with FSDP2 and DDP (pp 2 x dp 2, 4 ranks). The global norm equals torchtitan's
``clip_grad_norm_(..., pp_mesh=)`` and the unsplit model's; the loss is the last stage's only;
the four NaN sites of the pipeline notes name the right stage, rank and micro-batch.
Two launches (one per world size), every case inside them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.distributed.utils")

from ddpmon.config import Config  # noqa: E402
from ddpmon.forensics.timeline import describe  # noqa: E402
from tests.parallel._pp_worker import (  # noqa: E402
    FAIL_RANK,
    FAIL_STEP,
    NAN_MB,
    NAN_STEP,
    SCHEDULES,
    STEPS,
)
from tests.support.ranks import run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("_pp_worker.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def pp_only(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    return run_ranks(WORKER, out, ["--dp", "none", "--nan"])


@pytest.fixture(scope="module")
def pp_dp(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_dp")
    args = ("--dp", "fsdp2,ddp", "--nan-dp", "fsdp2", "--fail-dp", "fsdp2")
    return run_ranks(WORKER, out, list(args), world=4)


def _cases(ranks: list[dict]):
    for rank in ranks:
        for dp, schedules in rank["norms"].items():
            for name, entry in schedules.items():
                yield rank["rank"], dp, name, entry


def _check_norms(ranks: list[dict], expected_strategy: dict[str, str]) -> None:
    seen = set()
    for rank, dp, name, entry in _cases(ranks):
        seen.add((dp, name))
        assert entry["strategy"] == expected_strategy[dp]
        assert entry["steps_total"] == STEPS  # micro-batches and the metadata pass are no steps
        assert entry["restored"]  # schedule.step is the class's again after close
        assert not any(entry["errors"].values()), entry["errors"]
        assert len(entry["steps"]) == STEPS
        # no hook on the persistent receive buffers (they would pile up step after step)
        assert entry["recv_hooks"] == 0, (rank, dp, name)
        for s in entry["steps"]:
            assert s["ours"] > 0.1
            assert math.isclose(s["ours"], s["titan"], rel_tol=TOL), (rank, dp, name, s)
            assert math.isclose(s["ours"], s["unsplit"], rel_tol=TOL), (rank, dp, name, s)
            assert math.isclose(s["clip"], s["titan"], rel_tol=TOL), (rank, dp, name, s)
        # steps differ (an SGD step happened between them), and the norm follows
        assert entry["steps"][0]["ours"] != entry["steps"][1]["ours"]
    assert seen == {(dp, n) for dp in expected_strategy for n in SCHEDULES}


def test_global_norm_equals_torchtitan_and_unsplit_pp_only(pp_only):
    _check_norms(pp_only, {"none": "pp"})
    # the receive buffers checked for hooks exist (rank 1 holds non-first stages)
    assert all(r["norms"]["none"][n]["recv_buffers"] > 0 for r in pp_only[1:] for n in SCHEDULES)


def test_global_norm_equals_torchtitan_and_unsplit_with_fsdp2_and_ddp(pp_dp):
    _check_norms(pp_dp, {"fsdp2": "pp+fsdp2", "ddp": "pp+ddp"})


def _all_reduces(dp: str, step: int) -> int:
    """The global norm's one all-reduce, and at the update figures' sampled steps (the default
    ``update_every``) under FSDP2 their sum over the stage's dp mesh (probes.updates)."""
    return 1 + (dp == "fsdp2" and step % Config().update_every == 0)


def test_one_all_reduce_per_step_folded_into_the_shard_reduction(pp_only, pp_dp):
    """The global norm costs one small all-reduce per step: under pp + FSDP2 the pp sum is folded
    into the shard reduction (each stage's block at its own offset of one vector, summed over
    the dp x pp world at once), not a second all-reduce over the pp group after the first; pp
    alone has only the pp sum. Counted around ``schedule.step()`` and ``optimizer.step()`` (FSDP2
    itself never all-reduces). ``ddpmon.clip_grad_norm_`` under pp + FSDP2 reuses that reduction,
    already summed over every stage: no collective at all; pp alone sums over the pp group."""
    for rank, dp, name, entry in _cases(pp_only + pp_dp):
        if dp in ("none", "fsdp2"):
            expected = [_all_reduces(dp, s["step"]) for s in entry["steps"]]
            assert [s["all_reduces"] for s in entry["steps"]] == expected, (rank, dp, name)
            assert len(expected) == STEPS
        if dp == "fsdp2":
            assert entry["clip_reused"] == STEPS, (rank, name)
            assert [s["clip_all_reduces"] for s in entry["steps"]] == [0] * STEPS, (rank, name)
        if dp == "none":
            assert [s["clip_all_reduces"] for s in entry["steps"]] == [1] * STEPS, (rank, name)


def test_a_failed_measurement_under_fsdp2_still_reduces_and_no_rank_reports_a_norm(pp_dp):
    """pp 2 x FSDP2 dp 2: one rank's norm pass raises at one step. That rank still joins the
    one folded all-reduce (zeros and a failure flag), so no rank hangs, every rank reports no
    norm for that step (None, never NaN), and the steps around it are right everywhere.
    ``ddpmon.clip_grad_norm_`` on that step: every rank leaves the step's reduction alike and
    computes the norm again (shard sum + pp sum), so it is still torchtitan's, and no rank
    hangs; on the other steps it reuses the reduction (no collective). The last step does not
    clip: its all-reduce is finished by the record thread, and its norm is right too."""
    for rank in pp_dp:
        result = rank["fail_dp"]
        steps = result["steps"]
        errors = {probe: n for probe, n in result["errors"].items() if n}
        assert errors == ({"grads": 1} if rank["rank"] == FAIL_RANK else {}), (rank["rank"], errors)
        assert [s["all_reduces"] for s in steps] == [_all_reduces("fsdp2", s["step"])
                                                     for s in steps], rank["rank"]
        for s in steps:
            if s["clip"] is not None:
                assert math.isclose(s["clip"], s["titan"], rel_tol=TOL), (rank["rank"], s)
            if s["step"] == FAIL_STEP:
                assert s["ours"] is None, (rank["rank"], s)
                assert s["clip_all_reduces"] == 2, (rank["rank"], s)
            else:
                assert math.isclose(s["ours"], s["titan"], rel_tol=TOL), (rank["rank"], s)
                assert s["clip_all_reduces"] == 0, (rank["rank"], s)
        # without a clip nothing on the training thread waited for the folded all-reduce: the
        # step was queued with it in flight, and its norm above is still torchtitan's
        assert steps[-1]["clip"] is None and result["deferred"][-1] is True, result["deferred"]


ACTIVATION_BYTES = 2 * 6 * 16 * 4  # one micro-batch's activation: 2 x T x D float32


def test_send_recv_are_timed_per_micro_batch_and_stage(pp_only, pp_dp):
    """One send and one recv per micro-batch and stage boundary in each direction (the notes'
    8 ops per rank for 2 stages, 24 for 4 stages on 2 ranks), each timed within the step;
    the inner strategy's collectives are recorded beside them."""
    inner_ops = {"none": set(), "fsdp2": {"reduce_scatter", "all_gather"}, "ddp": {"all_reduce"}}
    for rank, dp, name, entry in _cases(pp_only + pp_dp):
        per_rank = 12 if name == "Interleaved1F1B" else 4
        for s in entry["steps"]:
            assert s["comm_count"]["send"] == s["comm_count"]["recv"] == per_rank, (rank, dp, s)
            assert s["comm_bytes"]["send"] == s["comm_bytes"]["recv"] == per_rank * ACTIVATION_BYTES
            assert set(s["comm_count"]) == {"send", "recv"} | inner_ops[dp], (rank, dp, s)
            for op, longest in s["comm_max"].items():
                assert 0 < longest < s["duration"], (rank, dp, name, op, s)


def test_stage_local_norms_add_up_to_the_global_norm(pp_only):
    """pp only: each rank's local norm is its stages' norm; their squares sum to the global."""
    for name in SCHEDULES:
        for step in range(STEPS):
            local = [r["norms"]["none"][name]["steps"][step]["local"] for r in pp_only]
            ours = pp_only[0]["norms"]["none"][name]["steps"][step]["ours"]
            assert all(v is not None and v > 0 for v in local)
            assert math.isclose(math.sqrt(sum(v * v for v in local)), ours, rel_tol=TOL)


def test_names_and_groups_carry_the_stage(pp_only):
    """The ModuleList split renumbers layers: stage 1's layers.0 is the unsplit layers.2."""
    by_rank = {r["rank"]: r["norms"]["none"] for r in pp_only}
    assert by_rank[0]["1F1B"]["names"][1] == "stage0.layers.0.fc1.weight"
    assert by_rank[1]["1F1B"]["names"][0] == "stage1.layers.0.fc1.weight"
    # two stages on one rank (Interleaved1F1B, 4 stages on 2 ranks): (0, 2) and (1, 3)
    for rank, stages in ((0, {"stage0", "stage2"}), (1, {"stage1", "stage3"})):
        entry = by_rank[rank]["Interleaved1F1B"]
        assert {n.split(".")[0] for n in entry["names"]} == stages
        assert len(set(entry["names"])) == len(entry["names"])
        assert {g.split(".")[0] for g in entry["steps"][0]["groups"]} == stages


def test_loss_only_on_the_last_stage(pp_only, pp_dp):
    for rank, dp, name, entry in _cases(pp_only + pp_dp):
        for s in entry["steps"]:
            if entry["last"]:
                assert s["loss"] is not None
                if dp == "none":  # the last stage's mean over micro-batches = unsplit loss
                    assert math.isclose(s["loss"], s["ref_loss"], rel_tol=TOL)
            else:
                assert s["loss"] is None  # the -1.0 it was given is dropped
        if "loss_lines" in entry:  # scraped over HTTP: no sample at all off the last stage
            assert len(entry["loss_lines"]) == (1 if entry["last"] else 0), (rank, dp, name)
            assert f'strategy="{entry["strategy"]}"' in entry["info"][0]


EXPECTED_ORIGIN = {
    # site: (origin rank = stage, micro-batch, site label)
    "param_grad": (1, None, "param_grad"),
    "activation_grad_last": (1, NAN_MB, "activation_grad"),
    "activation_grad_first": (0, None, "param_grad"),
    "activation": (0, NAN_MB, "activation"),
}


@pytest.mark.parametrize("site", sorted(EXPECTED_ORIGIN))
def test_nan_origin_names_stage_rank_and_microbatch(pp_only, site):
    origin_rank, mb, label = EXPECTED_ORIGIN[site]
    for rank in pp_only:
        result = rank["nan"][site]
        records = {r["step"]: r for r in result["records"]}
        assert not any(result["errors"].values()), result["errors"]
        assert records[NAN_STEP - 1]["grad_norm"] > 0  # clean before
        assert records[NAN_STEP]["grad_norm"] == "nan"  # the global norm is NaN everywhere
        at = records[NAN_STEP]
        if rank["rank"] == origin_rank:
            assert result["origin_total"] == 1
            assert at["origin"] and not at["poisoned"]
            where = at["pp_origin"]
            assert (where["stage"], where["microbatch"], where["site"]) == (origin_rank, mb, label)
            assert at["local_nonfinite_param"].startswith(f"stage{origin_rank}.")
            (event,) = result["events"]  # events.jsonl and the timeline name it too
            assert (event["stage"], event["microbatch"], event["site"]) == (origin_rank, mb, label)
            assert f"site={label}" in describe(event) and f"stage={origin_rank}" in describe(event)
        else:
            assert result["origin_total"] == 0
            assert not at["origin"] and at["pp_origin"] is None
            assert result["events"] == []
        # the step after the NaN was applied: never an origin again
        after = records[NAN_STEP + 1]
        assert not after["origin"]
        assert after["poisoned"] == after["local_nonfinite"]


def test_activation_grad_nan_on_the_last_stage_under_fsdp2_names_that_rank(pp_dp):
    """pp 2 x FSDP2 dp 2 (ranks 0-1: stage 0, ranks 2-3: stage 1), 1F1B: an activation-gradient
    NaN inside stage 1 on rank 2 only (dp replica 0). Rank 2 is the origin (stage 1, micro-batch
    1); its dp peer (rank 3) gets NaN only through the reduce-scatter and its pipeline peer
    (rank 0) only through the gradient it received: neither is an origin."""
    for rank in pp_dp:
        result = rank["nan_dp"]["activation_grad_last"]
        records = {r["step"]: r for r in result["records"]}
        assert not any(result["errors"].values()), result["errors"]
        at = records[NAN_STEP]
        assert at["grad_norm"] == "nan"
        if rank["rank"] == 2:
            assert result["origin_total"] == 1 and at["origin"]
            where = at["pp_origin"]
            assert (where["stage"], where["microbatch"], where["site"]) == (
                1, NAN_MB, "activation_grad"
            )
        else:
            assert result["origin_total"] == 0 and not at["origin"], rank["rank"]
        assert at["local_nonfinite"] == (rank["rank"] in (0, 2)), rank["rank"]
        assert not records[NAN_STEP + 1]["origin"]


def test_skip_policy_decides_alike_on_every_stage(pp_only):
    """on_nonfinite='skip' with a NaN only in stage 1's gradients: both stages drop the step
    (the decision reads the pp-summed norm), so no weight is poisoned and the next step is
    clean on both."""
    for rank in pp_only:
        result = rank["nan"]["param_grad+skip"]
        records = {r["step"]: r for r in result["records"]}
        assert not any(result["errors"].values()), result["errors"]
        assert records[NAN_STEP]["skipped_by"] == "policy", rank["rank"]
        assert records[NAN_STEP]["grad_norm"] == "nan"
        after = records[NAN_STEP + 1]
        assert after["skipped_by"] is None and after["grad_norm"] > 0
        assert not after["local_nonfinite"] and not after["poisoned"]
        assert result["origin_total"] == (1 if rank["rank"] == 1 else 0)


@pytest.mark.parametrize("dp", ["fsdp2", "ddp"])
def test_identical_batches_are_counted_within_a_stages_dp_group(pp_dp, dp):
    """pp 2 x dp 2, checked every step: steps 0-1 feed both dp ranks of each stage the same
    batch, steps 2-3 their own slices. The peer is counted on every rank, the pp peer never."""
    for rank in pp_dp:
        got = rank["data_check"][dp]
        assert got["identical"] == [1, 1, 0, 0], (rank["rank"], dp, got["identical"])
        assert {k: v for k, v in got["errors"].items() if v} == {}, got["errors"]
        if rank["rank"] == 0:
            assert got["manifest"]["data_check"] == {
                "every": 1, "over": "each stage's data-parallel group (the ranks that hold the "
                "same stage)"}


def test_each_stages_ddp_replicas_are_compared_and_agree(pp_dp):
    """pp x DDP: the ranks of a stage's dp group hold the same stage, bit for bit, and the
    replica checksums compare them over that group (at the first step of the process, then
    every ``replica_check_every``); a clean run raises nothing. pp x FSDP2 shards each stage:
    nothing to compare."""
    seen = set()
    for _, dp, _, entry in _cases(pp_dp):
        seen.add(dp)
        if dp == "ddp":
            assert entry["replicas_over"].startswith("each stage's data-parallel group")
            assert entry["replica_mismatches"] == 0
        else:
            assert entry["replicas_over"] is None and entry["replica_mismatches"] is None
    assert seen == {"ddp", "fsdp2"}
