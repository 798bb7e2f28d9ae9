"""FSDP2, HSDP, TP and FSDP2+TP gradient sources against torch's own numbers, on real gloo ranks.

Each launch drives the source the way the step pipeline does (``on_backward_end`` after every
backward, then the user's in-place clip, then ``collect``) and records torch's references: the
value ``clip_grad_norm_`` returns (pre-clip; ``.full_tensor()`` for DTensor, per parameter where
torch refuses the mix) and, for FSDP2/HSDP, the norm of this rank's unreduced gradients from a
plain copy of the model fed the same batches.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.parallel._worker import (
    NAN_PARAM,
    NAN_RANK,
    NAN_STEP,
    SAMPLED_EVERY,
    TOUCH_STEP,
    USER_MAX_NORM,
)
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_worker.py")

REL = 1e-5
STRATEGIES = [
    # (strategy, ranks, expected kind, local norm complete)
    ("fsdp2", 2, "fsdp2", True),
    ("hsdp", 4, "hsdp", True),
    ("tp", 2, "tp", False),
    ("fsdp2+tp", 4, "fsdp2+tp", False),
]


# Strategies of one world size share a launch: the ranks start once and run them in turn.
LAUNCHES = {2: ("fsdp2", "tp"), 4: ("hsdp", "fsdp2+tp")}


@pytest.fixture(scope="module")
def ranks_of(tmp_path_factory):
    """``ranks_of(strategy, n)``: each rank's results for ``strategy`` (scenarios, FSDP1 kind)
    and the launch's threads after destroy; one launch per world size, cached per module."""
    done: dict[int, list[dict]] = {}

    def get(strategy: str, n: int) -> list[dict]:
        assert strategy in LAUNCHES[n], (strategy, n)
        if n not in done:
            out = tmp_path_factory.mktemp(f"ranks{n}")
            done[n] = run_ranks(WORKER, out, ["--strategy", ",".join(LAUNCHES[n])], world=n)
        return [
            {
                "rank": rank["rank"],
                **rank["strategies"][strategy],
                "comm_threads_after_destroy": rank["comm_threads_after_destroy"],
            }
            for rank in done[n]
        ]

    return get


def _total(vector: dict) -> float:
    return math.sqrt(sum(n * n for n in vector["norms"]))


def _first_bad(vector: dict) -> int:
    bad = [
        p for n, p in zip(vector["norms"], vector["positions"], strict=True) if not math.isfinite(n)
    ]
    return min(bad) if bad else -1


def _close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _group_norms(
    values: list[float], positions: list[int], group_of: list[int], n: int
) -> list[float]:
    sq = [0.0] * n
    for value, pos in zip(values, positions, strict=True):
        sq[group_of[pos]] += value * value
    return [math.sqrt(v) for v in sq]


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_detects_strategy_and_no_probe_errors(ranks_of, strategy, n, kind, _):
    for rank in ranks_of(strategy, n):
        for name, scenario in rank["scenarios"].items():
            assert scenario["kind"] == kind, name
            assert scenario["source"] == kind, name
            assert scenario["errors"] == [], (name, scenario["errors"])


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_reduced_norm_is_torchs_pre_clip_norm_every_step(ranks_of, strategy, n, kind, _):
    checked = 0
    for rank in ranks_of(strategy, n):
        for name, scenario in rank["scenarios"].items():
            width = len(scenario["group_names"])
            for rec in scenario["records"]:
                if name in ("nan", "sampled") and rec["step"] >= NAN_STEP:
                    continue
                ref = rec["ref_total"]
                assert ref > 2 * USER_MAX_NORM  # the user's clip really changed the gradients
                assert _close(rec["post_clip_norm"], USER_MAX_NORM, 1e-3)
                reduced = rec["reduced"]
                assert reduced is not None, (name, rec["step"])
                assert _close(_total(reduced), ref), (name, rec["step"], _total(reduced), ref)
                assert _close(rec["clip_norm"], ref), (name, rec["step"])
                ours = _group_norms(
                    reduced["norms"], reduced["positions"], scenario["group_of"], width
                )
                theirs = _group_norms(
                    rec["ref_params"],
                    list(range(len(rec["ref_params"]))),
                    scenario["group_of"],
                    width,
                )
                for group, a, b in zip(scenario["group_names"], ours, theirs, strict=True):
                    assert _close(a, b), (name, rec["step"], group, a, b)
                checked += 1
    assert checked >= n * 12


@pytest.mark.parametrize(("strategy", "n", "kind", "complete"), STRATEGIES)
def test_local_pre_reduction_norms(ranks_of, strategy, n, kind, complete):
    seen_distinct = set()
    for rank in ranks_of(strategy, n):
        for name, scenario in rank["scenarios"].items():
            if name in ("unused", "sampled"):
                continue  # their own tests
            for rec in scenario["records"]:
                if name in ("nan", "sampled") and rec["step"] >= NAN_STEP:
                    continue
                local = rec["local"]
                assert local is not None, (name, rec["step"])
                assert rec["local_complete"] is complete
                assert _first_bad(local) == -1
                if rec["local_ref"] is not None:
                    # bf16 parameters compute different gradients than the fp32 reference copy
                    rel = 2e-2 if name == "no_reshard_mp" else REL
                    assert _close(_total(local), rec["local_ref"], rel), (name, rec["step"])
                if name == "nested" and rec["step"] == 0:
                    seen_distinct.add(round(_total(local), 9))
    assert len(seen_distinct) > 1  # ranks' local gradients differ: it is not the reduced one


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_nan_in_one_named_gradient_on_one_rank(ranks_of, strategy, n, kind, _):
    results = ranks_of(strategy, n)
    names = results[0]["scenarios"]["nan"]["names"]
    target = names.index(NAN_PARAM)
    for rank in results:
        rec = rank["scenarios"]["nan"]["records"][NAN_STEP]
        assert _first_bad(rec["reduced"]) == target  # everyone sees the global NaN, named
        expected = target if rank["rank"] == NAN_RANK else -1
        assert _first_bad(rec["local"]) == expected, rank["rank"]
        if expected >= 0:
            slot = rec["local"]["positions"].index(target)
            assert math.isnan(rec["local"]["norms"][slot])


@pytest.mark.parametrize(("strategy", "n"), [("fsdp2", 2), ("hsdp", 4), ("fsdp2+tp", 4)])
def test_sampled_local_pass_keeps_the_origin_exact_on_every_step(ranks_of, strategy, n):
    """``local_norm_every`` on CPU: the norm pass over the reduce-scatter input runs on sampled
    steps only; on the others a sum of the buffer decides, and a non-finite one runs the pass at
    once. The NaN at a non-sampled step is still named on its rank only, and the reduced norms
    are those of every step."""
    results = ranks_of(strategy, n)
    names = results[0]["scenarios"]["sampled"]["names"]
    target = names.index(NAN_PARAM)
    assert NAN_STEP % SAMPLED_EVERY != 0
    for rank in results:
        records = rank["scenarios"]["sampled"]["records"]
        for rec in records[:NAN_STEP]:
            sampled = rec["step"] % SAMPLED_EVERY == 0
            assert (rec["local"] is not None) is sampled, rec["step"]
            assert _close(_total(rec["reduced"]), rec["ref_total"])
            if sampled and rec["local_ref"] is not None:
                assert _close(_total(rec["local"]), rec["local_ref"])
        rec = records[NAN_STEP]
        assert _first_bad(rec["reduced"]) == target
        if rank["rank"] == NAN_RANK:
            assert _first_bad(rec["local"]) == target
            assert rec["local_complete"] is False  # only the unit with the NaN was measured
        else:
            assert rec["local"] is None  # its sums were finite: no pass, no origin
        # After the NaN step was applied every rank's gradients are non-finite: measured.
        for rec in records[NAN_STEP + 1 :]:
            assert rec["local"] is not None and _first_bad(rec["local"]) >= 0


def test_fsdp2_accumulation_measures_once_and_matches(ranks_of):
    """Two micro-steps, sync on the last only: the no-sync backward adds no measurement and the
    numbers are those of the accumulated gradients (checked above); local is exact."""
    for rank in ranks_of("fsdp2", 2):
        scenario = rank["scenarios"]["accum"]
        assert len(scenario["records"]) >= 4
        for rec in scenario["records"]:
            assert rec["local_complete"] is True
            assert _close(_total(rec["local"]), rec["local_ref"])
            assert sorted(rec["local"]["positions"]) == list(range(len(scenario["names"])))


def test_fsdp2_unit_with_a_parameter_without_gradient(ranks_of):
    """A unit whose ``spare`` parameter gets no gradient: the reduce-scatter layout is ambiguous,
    so the unit is judged whole; its local norm is still right but flagged incomplete."""
    for rank in ranks_of("fsdp2", 2):
        scenario = rank["scenarios"]["unused"]
        assert "blocks.1.spare.weight" in scenario["names"]
        for rec in scenario["records"]:
            assert rec["local_complete"] is False
            assert _first_bad(rec["local"]) == -1
            assert _close(_total(rec["local"]), rec["local_ref"])
            assert _close(_total(rec["reduced"]), rec["ref_total"])


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_no_comm_thread_outlives_destroy(ranks_of, strategy, n, kind, _):
    """After ``destroy_process_group_now`` no gloo or TCPStore thread is left to run into
    interpreter exit, where one crashed a rank (rarely, after its results were written). A new
    torch cache that keeps a process group alive fails here, every time."""
    for rank in ranks_of(strategy, n):
        threads = rank["comm_threads_after_destroy"]
        if threads is None:
            pytest.skip("no /proc/self/task to list threads")
        assert threads == [], (rank["rank"], threads)


def test_fsdp1_is_reported_unsupported(ranks_of):
    assert {rank["fsdp1_kind"] for rank in ranks_of("fsdp2", 2)} == {"unsupported:fsdp1"}


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_clip_norm_reuses_the_reduction_only_for_unchanged_gradients(
    ranks_of, strategy, n, kind, _
):
    """Before the user's clip ``clip_norm`` is answered from the step's reduction (checked equal
    to torch above) except at TOUCH_STEP, where an in-place op changed the gradients; after the
    clip (a second call) the changed gradients are measured again."""
    for rank in ranks_of(strategy, n):
        for name, scenario in rank["scenarios"].items():
            touched = 1 if len(scenario["records"]) > TOUCH_STEP else 0
            assert scenario["clip_reused"] == len(scenario["records"]) - touched, name
            for rec in scenario["records"]:
                if name in ("nan", "sampled") and rec["step"] >= NAN_STEP:
                    continue
                assert _close(rec["clip_after"], rec["post_clip_norm"]), (name, rec["step"])


# Identical batches on every rank: other ranks counted over the groups the check gathers in.
# HSDP: the shard group and the replicate group (1 + 1 of the 3 others); FSDP2+TP: the dp dim
# only (its TP peer shares the batch by design, and holds other shards).
DUPLICATES = {"fsdp2": 1, "hsdp": 2, "fsdp2+tp": 1}


@pytest.mark.parametrize(("strategy", "n", "kind", "_"), STRATEGIES)
def test_identical_batches_are_counted_where_data_parallel_ranks_exist(
    ranks_of, strategy, n, kind, _
):
    for rank in ranks_of(strategy, n):
        scenarios = rank["scenarios"]
        # distinct batches, checked on every step: never identical
        assert {r["identical_ranks"] for r in scenarios["nested"]["records"]} == (
            {0} if strategy in DUPLICATES else {None}), (rank["rank"], strategy)
        if strategy not in DUPLICATES:
            assert "dupdata" not in scenarios  # TP alone has no data-parallel peers
            continue
        counted = [r["identical_ranks"] for r in scenarios["dupdata"]["records"]]
        assert counted == [DUPLICATES[strategy]] * 2, (rank["rank"], strategy, counted)
