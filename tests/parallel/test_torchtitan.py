"""torchtitan's real ``Trainer`` (0.3.0, llama3 debug model) on 2 CPU ranks with the one
``ddpmon.attach`` line at the end of ``Trainer.__init__`` (tests/parallel/_titan_worker.py: the
marked CPU patches are torchtitan's, none is ddpmon's). Under FSDP (dp_shard=2) and under TP=2:
every step recorded, ddpmon's global norm against an fp64 reference of the full gradients on
every clean step, the loss the trainer handed over (a DTensor under TP) recorded as its value,
and a NaN put into the gradient of ``layers.3``'s output on rank 1 named at rank 1, its step
and a ``layers.3`` parameter (under TP, told from rank 0 by where it entered each rank: the
block whose output gradient went non-finite first); the manifest's precision is bf16, from
torchtitan's FSDP2 mixed-precision policy. One launch per parallelism."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.distributed.utils")

from ddpmon.forensics.timeline import build_timeline  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("_titan_worker.py")
STEPS = 4
NAN_STEP = STEPS - 1
"""The last: the trainer stops on the non-finite loss that would follow."""
NAN_RANK = 1
NAN_LAYER = "layers.3"
NORM_TOL = 1e-7
"""Relative: the issue's bar (torchtitan's own float32 norm is 1e-5 off under FSDP)."""


@pytest.fixture(scope="module", params=["fsdp", "tp"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    args = ["--mode", request.param, "--steps", str(STEPS), "--nan-step", str(NAN_STEP),
            "--nan-rank", str(NAN_RANK), "--nan-layer", NAN_LAYER]
    return request.param, out, run_ranks(WORKER, out, args, timeout=300)


def test_every_step_is_recorded_with_its_loss(run):
    mode, _, ranks = run
    for rank in ranks:
        assert rank["enabled"] and rank["error"] is None, rank
        assert rank["strategy"] == ("fsdp2" if mode == "fsdp" else "fsdp2+tp")
        assert not rank["errors"], rank["errors"]
        assert [s["step"] for s in rank["steps"]] == list(range(STEPS))
        # the loss the trainer's forward_backward_step returned: a DTensor under TP
        assert set(rank["loss_types"]) == {"DTensor" if mode == "tp" else "Tensor"}
        if mode == "tp":  # loss-parallel cross entropy: the full loss on every TP rank (str: "R")
            assert {tuple(p) for p in rank["loss_placements"]} == {("R",)}
        assert [s["loss"] for s in rank["steps"]] == pytest.approx(rank["losses"], rel=1e-6)


def test_the_global_norm_matches_an_fp64_reference_on_every_step(run):
    _, _, ranks = run
    for rank in ranks:
        steps, refs = rank["steps"], rank["references"]
        assert len(refs) == STEPS
        for step in range(NAN_STEP):
            ours, ref = steps[step]["grad_norm"], refs[step]
            assert ours is not None, (rank["rank"], step)
            assert abs(ours - ref) <= NORM_TOL * ref, (rank["rank"], step, ours, ref)
        assert math.isnan(steps[NAN_STEP]["grad_norm"]) and math.isnan(refs[NAN_STEP])


def test_the_nan_is_named_at_its_rank_step_and_layer(run):
    mode, out, ranks = run
    for rank in ranks:
        assert not any(s["origin"] for s in rank["steps"][:NAN_STEP]), rank["rank"]
    flagged = [r["rank"] for r in ranks if r["steps"][NAN_STEP]["origin"]]
    if mode == "fsdp":
        # the NaN stays on rank 1 until its reduce-scatter: rank 1 alone is the origin
        assert flagged == [NAN_RANK]
    else:
        # TP (with torchtitan's sequence parallel) all-gathers activation gradients inside
        # w2's backward, so the NaN reaches both ranks' local gradients of layers.3 in the same
        # backward: each rank's own parameters say "origin" and name the same tensor. The
        # gradient between blocks is sequence-sharded (rank-local): layers.3's output gradient
        # is non-finite on rank 1 only; rank 0 sees it first at layers.2's, after attention's
        # backward mixed the tokens (strategies/block_entry.py)
        assert sorted(flagged) == [0, 1]
        entries = {r["rank"]: r["steps"][NAN_STEP]["entry_block"] for r in ranks}
        assert entries == {NAN_RANK: NAN_LAYER, 1 - NAN_RANK: "layers.2"}, entries
    for rank in ranks:
        if rank["rank"] in flagged:
            param = rank["steps"][NAN_STEP]["local_nonfinite_param"]
            assert param.startswith(NAN_LAYER + "."), (rank["rank"], param)
    first = build_timeline(out / "run").first_failure
    assert first is not None and first["step"] == NAN_STEP, first
    assert first["rank"] == NAN_RANK and first["class"] == "origin", first
    assert first["param"].startswith(NAN_LAYER + "."), first
    assert "tied_ranks" not in first, first
    if mode == "tp":
        assert first["entry"] == NAN_LAYER, first


def test_the_manifest_gives_bf16_parameters_under_the_mixed_precision_policy(run):
    """torchtitan's default ``mixed_precision_param = "bfloat16"``: FSDP2's policy (on its
    one-rank dp mesh beside TP too) computes in bf16 over fp32 storage."""
    _, _, ranks = run
    for rank in ranks:
        assert rank["precision"] == "bf16", rank["precision"]
    manifests = [r["manifest"] for r in ranks if r["manifest"] is not None]
    assert manifests, "no manifest written"
    for manifest in manifests:
        assert manifest["precision"] == "bf16", manifest.get("precision_detail")
        detail = manifest["precision_detail"]
        assert detail["params"] == "bf16" and detail["storage"] == "fp32", detail
        assert detail["params_from"] == "fsdp2 MixedPrecisionPolicy", detail
