"""Every 2-rank mesh shape through ``ddpmon.attach``, on real gloo ranks: FSDP2 on a one-rank
dp mesh beside TP (torchtitan's TP layout, where FSDP2 skips its reduce-scatter), HSDP with a
one-rank replicate or shard dim, TP alone, FSDP2, DDP and plain. Per step, ddpmon's global and
group norms against an fp64 reference the worker computes from the full gradients
(``.full_tensor()``) and against ``clip_grad_norm_``; the collectives that run are timed; no
agent error. The last step puts a NaN into a gradient on rank 1: into one parameter's gradient
(it stays there: named on rank 1 only), or into a middle layer's output gradient (every layer
below it turns non-finite too: the origin is a parameter of that layer, the first non-finite in
backward order)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.parallel._mesh_worker import NAN_LAYER, NAN_PARAM, NAN_RANK, STEPS
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_mesh_worker.py")
REL = 1e-7  # docs/parallelism.md#precision
TORCH_REL = 1e-5  # torch's own float32 norm
SHAPES = {
    # worker shape: (ddpmon's strategy, the collectives ddpmon times there)
    "dp1+tp": ("fsdp2+tp", set()),  # no FSDP2 collective runs on a one-rank dp mesh
    "hsdp-r1": ("hsdp", {"all_gather", "reduce_scatter", "all_reduce"}),
    "hsdp-s1": ("hsdp", {"all_reduce"}),  # the shard dim has one rank: no gather, no scatter
    "tp": ("tp", set()),
    "fsdp2": ("fsdp2", {"all_gather", "reduce_scatter"}),
    "fsdp2-bf16": ("fsdp2", {"all_gather", "reduce_scatter"}),  # MixedPrecisionPolicy
    "ddp": ("ddp", {"all_reduce"}),
    "plain": ("plain", set()),
}
PARAM_RUN = ("dp1+tp", "hsdp-r1", "hsdp-s1", "fsdp2-bf16")
ACTIVATION_RUN = ("plain", "ddp", "fsdp2", "dp1+tp", "hsdp-s1", "tp")
TP_SHAPES = ("dp1+tp", "tp")  # a NaN in an activation's gradient crosses TP ranks in backward


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(nan: str) -> list[dict]:
        if nan not in cache:
            shapes = PARAM_RUN if nan == "param" else ACTIVATION_RUN
            out = tmp_path_factory.mktemp(f"mesh_{nan}")
            cache[nan] = run_ranks(WORKER, out, ["--shapes", ",".join(shapes), "--nan", nan],
                                   world=2, timeout=400)
        return cache[nan]

    return get


def _rel(ours: float, ref: float) -> float:
    return abs(ours - ref) / ref


def _shapes(runs):
    for nan, shapes in (("param", PARAM_RUN), ("activation", ACTIVATION_RUN)):
        for rank in runs(nan):
            for shape in shapes:
                yield shape, rank["rank"], rank["shapes"][shape]


@pytest.mark.parametrize("nan", ["param", "activation"])
def test_norms_exact_against_fp64_and_torch_on_every_step(runs, nan):
    shapes = PARAM_RUN if nan == "param" else ACTIVATION_RUN
    for rank in runs(nan):
        for shape in shapes:
            result = rank["shapes"][shape]
            assert result["kind"] == SHAPES[shape][0], (shape, result["kind"])
            assert [o["step"] for o in result["ours"]] == list(range(STEPS))
            clean = zip(result["ours"][:-1], result["refs"][:-1], result["clips"][:-1],
                        strict=True)
            for ours, ref, clip in clean:
                assert ours["global"] is not None, (shape, ours)
                assert _rel(ours["global"], ref["global"]) <= REL, (shape, ours, ref)
                assert set(ours["groups"]) == set(ref["groups"]), (shape, ours)
                for group, want in ref["groups"].items():
                    assert _rel(ours["groups"][group], want) <= REL, (shape, group, ours, want)
                if clip is not None:  # torch refuses a mix of meshes (TP beside plain layers)
                    assert _rel(ours["global"], clip) <= TORCH_REL, (shape, ours, clip)
            last = result["ours"][-1]
            if shape != "plain" or rank["rank"] == NAN_RANK:  # plain: ranks train apart
                assert last["global"] is not None and math.isnan(last["global"]), (shape, last)
            errors = {k: v for k, v in result["errors"].items() if v}
            assert errors == {}, (shape, rank["rank"], errors)


@pytest.mark.parametrize("nan", ["param", "activation"])
def test_the_collectives_that_run_are_timed(runs, nan):
    shapes = PARAM_RUN if nan == "param" else ACTIVATION_RUN
    for rank in runs(nan):
        for shape in shapes:
            for step in rank["shapes"][shape]["ours"]:
                timed = {op for op, n in step["collective_bytes"].items() if n > 0}
                assert timed == SHAPES[shape][1], (shape, step)


def test_a_nan_in_one_parameter_gradient_is_named_at_rank_1_only(runs):
    for rank in runs("param"):
        for shape in PARAM_RUN:
            last = rank["shapes"][shape]["ours"][-1]
            if rank["rank"] == NAN_RANK:
                assert last["origin"] and last["local_nonfinite_param"] == NAN_PARAM, (shape, last)
            else:
                assert not last["local_nonfinite"] and not last["origin"], (shape, last)
            for step in rank["shapes"][shape]["ours"][:-1]:
                assert not step["local_nonfinite"], (shape, step)


def test_a_nan_begun_in_a_middle_layer_is_named_there(runs):
    """The NaN enters the output gradient of ``layers.2`` on rank 1; ``layers.1``, ``layers.0``
    and ``embed`` turn non-finite after it. Rank 1's origin is a ``layers.2`` parameter. Under
    data parallelism rank 0 stays finite; under TP the NaN reaches rank 0 through the
    activation all-reduce of ``layers.2``'s column-wise input, so rank 0 names a parameter of
    ``layers.2`` too, but one later in backward order than rank 1's."""
    by_rank = {rank["rank"]: rank["shapes"] for rank in runs("activation")}
    for shape in ACTIVATION_RUN:
        mine = by_rank[NAN_RANK][shape]
        last = mine["ours"][-1]
        assert last["origin"], (shape, last)
        assert last["local_nonfinite_param"].startswith(NAN_LAYER + "."), (shape, last)
        other = by_rank[1 - NAN_RANK][shape]["ours"][-1]
        if shape not in TP_SHAPES:
            assert not other["local_nonfinite"] and not other["origin"], (shape, other)
            continue
        assert other["local_nonfinite_param"].startswith(NAN_LAYER + "."), (shape, other)
        order = mine["backward_order"]
        assert order.index(last["local_nonfinite_param"]) < order.index(
            other["local_nonfinite_param"]), (shape, last, other)


def test_the_measured_backward_order_runs_from_the_loss_to_the_input(runs):
    for _, _, result in _shapes(runs):
        order = result["backward_order"]
        assert sorted(order) == sorted(result["names"])
        layers = [int(n.split(".")[1]) for n in order if n.startswith("layers.")]
        assert layers == sorted(layers, reverse=True), order
        assert order.index("output.weight") < order.index("layers.3.w_out.weight")
        assert order.index("layers.0.norm.weight") < order.index("embed.weight")


def test_the_manifest_gives_the_precision_as_it_is(runs):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 parameters in
    the manifest and on ``ddpmon_rank_info{precision}``; fp32 where nothing casts."""
    for rank in runs("param"):
        shapes = rank["shapes"]
        mixed = shapes["fsdp2-bf16"]
        assert mixed["precision"] == "bf16"
        if mixed["manifest"] is not None:  # rank 0 writes the run's manifest
            assert mixed["manifest"]["precision"] == "bf16"
            detail = mixed["manifest"]["precision_detail"]
            assert detail["params"] == "bf16" and detail["storage"] == "fp32"
            assert detail["reduce"] == "fp32" and detail["autocast"] is None
            assert detail["params_from"] == "fsdp2 MixedPrecisionPolicy"
        for shape in ("dp1+tp", "hsdp-r1", "hsdp-s1"):
            assert shapes[shape]["precision"] == "fp32", shape
    assert any(r["shapes"]["fsdp2-bf16"]["manifest"] is not None for r in runs("param"))
