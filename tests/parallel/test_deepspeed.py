"""``ddpmon.attach(engine)`` on real DeepSpeed ZeRO 0-3 (2 gloo ranks, ``DS_ACCELERATOR=cpu``).

One launch runs every config (stage x precision x accumulation) inside the same two workers
(``_deepspeed_worker.py``) and the tests check each config against DeepSpeed's own numbers:
``engine.get_global_grad_norm()``, ``engine.global_steps``, ``engine.skipped_steps``, the loss
scaler's ``cur_scale``, and the full gradients from ``deepspeed.utils.safe_get_full_grad``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.support.integrations import close  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

from . import _deepspeed_worker as W  # noqa: E402

WORKER = Path(W.__file__)
CONFIGS = W.configs()
UNREADABLE = ("z2-fp32-deepcompile", "z1-bf16-fp32accum", "z2-fp32-probe-fails")
MEASURED = [n for n in CONFIGS if n not in UNREADABLE]
REL = 1e-5
LOCAL_REL = 1e-6
# Configs where DeepSpeed applies the NaN step: stage 0 fp32 (nothing is skipped) and bf16
# without check_grad_overflow at ZeRO-1/2. Every later step is poisoned there.
APPLIED = {n for n in MEASURED if n.startswith("z0-fp32") or n in ("z1-bf16-nocheck",
                                                                     "z2-bf16-nocheck")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("deepspeed")
    results = run_ranks(
        WORKER, out, [], timeout=240,
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    return {"ranks": results, "out": out}


def rank_cfg(runs: dict, rank: int, name: str) -> dict:
    return runs["ranks"][rank]["configs"][name]


def finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_strategy_and_manifest(runs, name):
    cfg = CONFIGS[name]
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        assert res["attached"], res["error"]
        assert res["strategy"] == f"deepspeed-zero{cfg['stage']}"
        failing = name == "z2-fp32-probe-fails" and rank == 1
        assert res["errors"] == ({"grads": 1} if failing else {}), res["errors"]
    manifest = json.loads((Path(rank_cfg(runs, 0, name)["run_path"]) / "manifest.json").read_text())
    facts = manifest["extra"]["deepspeed"]
    assert facts["stage"] == cfg["stage"]
    assert facts["precision"] == cfg["precision"]
    assert facts["gradient_accumulation_steps"] == cfg["gas"]
    assert facts["gradient_clipping"] == W.CLIP
    assert manifest["extra"]["strategy"] == f"deepspeed-zero{cfg['stage']}"
    assert manifest["topology"]["backend"] == "gloo"  # deepspeed.init_distributed's group


@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_and_skipped_match_engine(runs, name):
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        records = res["records"]
        assert [r["step"] for r in records] == list(range(W.STEPS))
        assert res["steps_total"] == res["global_steps"][-1] == W.STEPS
        skipped_by_engine = [
            b - a for a, b in zip([0, *res["skipped_steps"]], res["skipped_steps"], strict=False)
        ]
        # fp16: DeepSpeed's loss scaler skipped (an AMP skip); bf16/fp32: its overflow check.
        fp16 = CONFIGS[name]["precision"] == "fp16"
        by = "scaler" if fp16 else "engine"
        assert [int(r["amp_skipped"]) for r in records] == [
            s if fp16 else 0 for s in skipped_by_engine
        ]
        assert [r["skipped_by"] == by for r in records] == [bool(s) for s in skipped_by_engine]
        if name not in APPLIED:  # the NaN step is skipped by DeepSpeed on every rank
            assert skipped_by_engine[W.NAN_STEP] == 1


@pytest.mark.parametrize("name", MEASURED)
def test_global_norm_equals_deepspeed_every_step(runs, name):
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        for step, rec in enumerate(res["records"]):
            ours, theirs = rec["grad_norm"], res["ds_norms"][step]
            if theirs is None:  # stage 0 fp32: DeepSpeed discards its norm; torch's instead
                theirs = res["ref_global"][step]
            assert ours is not None, (rank, step)
            assert close(float(ours), float(theirs), REL), (rank, step, ours, theirs)
            # the gathered full gradients say the same (and show the norm is pre-clip)
            if finite(ours):
                assert close(float(ours), res["ref_global"][step], REL)
                assert float(ours) > W.CLIP


@pytest.mark.parametrize("name", MEASURED)
def test_group_norms_with_original_names(runs, name):
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        for step, rec in enumerate(res["records"]):
            assert set(rec["group_norms"]) == set(W.GROUPS)
            for group, ref in res["ref_groups"][step].items():
                ours = float(rec["group_norms"][group])
                assert close(ours, ref, REL), (rank, step, group, ours, ref)


@pytest.mark.parametrize("name", MEASURED)
def test_local_norm_folds_micro_batches(runs, name):
    """sqrt(sum over micro-batches of the local gradient's squared norm), unscaled."""
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        for step, rec in enumerate(res["records"]):
            ref = res["ref_local"][str(step)]
            if not finite(ref):
                assert rec["local_nonfinite"]
                continue
            # float32 accumulation on CPU (as per_param_norms), the reference in float64
            assert close(float(rec["grad_local_norm"]), ref, LOCAL_REL), (rank, step)
        clean = [float(r["grad_local_norm"]) for r in res["records"][: W.NAN_STEP]]
        other = rank_cfg(runs, 1 - rank, name)["records"][: W.NAN_STEP]
        theirs = [float(r["grad_local_norm"]) for r in other]
        if CONFIGS[name].get("dupdata"):  # every rank seeded alike: the same batches
            assert clean == theirs
        else:
            assert clean != theirs  # per-rank data differs


@pytest.mark.parametrize("name", MEASURED)
def test_nan_origin_names_rank_step_param(runs, name):
    origin = rank_cfg(runs, W.NAN_RANK, name)
    other = rank_cfg(runs, 1 - W.NAN_RANK, name)
    found = [(r["step"], r["local_nonfinite_param"]) for r in origin["records"] if r["origin"]]
    assert found == [(W.NAN_STEP, W.NAN_PARAM)]
    assert origin["origin_steps"] == 1
    assert [r for r in other["records"] if r["origin"]] == []
    assert other["origin_steps"] == 0
    for res in (origin, other):  # the reduced gradients carry it on both ranks
        assert not finite(res["records"][W.NAN_STEP]["grad_norm"])
    later = [r for res in (origin, other) for r in res["records"][W.NAN_STEP + 1:]]
    if name in APPLIED:  # DeepSpeed applied the NaN: every later step is poisoned, no origin
        assert all(r["poisoned"] and not r["origin"] for r in later)
        assert other["poisoned_steps"] == W.STEPS - W.NAN_STEP - 1
    else:  # skipped: the weights stay clean
        assert all(finite(r["grad_norm"]) and not r["poisoned"] for r in later)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_scale_only_for_fp16(runs, name):
    fp16 = CONFIGS[name]["precision"] == "fp16"
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        scales = [r["loss_scale"] for r in res["records"]]
        assert res["amp_enabled"] is fp16
        if fp16:  # DeepSpeed's own scaler, read after every step; it halved at the NaN step
            assert scales == res["ds_scales"]
            assert scales[W.NAN_STEP] == scales[0] / 2
            assert res["amp_skipped_steps_total"] == res["skipped_steps"][-1]
        else:
            assert scales == [None] * W.STEPS and res["loss_scale"] is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_skipped_steps_equal_deepspeeds_with_who_skipped_them(runs, name):
    """ddpmon_steps_skipped_total equals engine.skipped_steps under fp32, bf16 and fp16: the
    loss scaler's skips under fp16 (``by="scaler"``), DeepSpeed's own overflow check's under
    bf16/fp32 (``by="engine"``); only the scaler's are AMP skips."""
    fp16 = CONFIGS[name]["precision"] == "fp16"
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        by = "scaler" if fp16 else "engine"
        assert res["steps_skipped_total"] == {by: res["skipped_steps"][-1]}, res["skipped_steps"]
        assert res["amp_skipped_steps_total"] == (res["skipped_steps"][-1] if fp16 else 0)
        skipped_by = {r["step"]: r["skipped_by"] for r in res["records"] if r["skipped_by"]}
        assert len(skipped_by) == res["skipped_steps"][-1] and set(skipped_by.values()) <= {by}


def test_a_zero2_fp32_nan_on_one_rank_shows_one_skipped_step_as_deepspeed_does(runs):
    for rank in (0, 1):
        res = rank_cfg(runs, rank, "z2-fp32-gas1")
        assert res["skipped_steps"][-1] == 1, "DeepSpeed skipped the NaN step"
        assert res["steps_skipped_total"] == {"engine": 1}


def test_attach_refusals_do_not_raise(runs):
    for rank in (0, 1):
        for name in CONFIGS:
            res = rank_cfg(runs, rank, name)
            assert not res["second_enabled"]
            assert "already attached to this DeepSpeedEngine" in res["second_attach_error"]
            assert res["reattach_after_close"]
            # engine.module with DeepSpeed's optimizer is refused; stage 0 fp32 keeps the torch
            # optimizer and plain parameters, so nothing tells its module apart (documented).
            if name.startswith("z0-fp32"):
                assert res["module_attach_error"] is None
            else:
                assert "not the DeepSpeedEngine" in res["module_attach_error"]


def test_unreadable_feature_warns_once_and_keeps_steps(runs):
    warning = "ddpmon: DeepSpeed DeepCompile is enabled; ddpmon cannot read its gradients"
    for rank in (0, 1):
        res = rank_cfg(runs, rank, "z2-fp32-deepcompile")
        # one per attach: the monitor, and the re-attach after it was closed
        assert runs["ranks"][rank]["stderr"].count(warning) == 2
        assert res["steps_total"] == W.STEPS
        assert all(r["grad_norm"] is None and r["grad_local_norm"] is None
                   for r in res["records"])
        assert res["skipped_steps"][-1] == 1  # fp32: DeepSpeed's overflow check
        assert sum(r["skipped_by"] == "engine" for r in res["records"]) == 1
        assert res["steps_skipped_total"] == {"engine": 1}


def test_unknown_optimizer_wrapper_warns_and_keeps_local_numbers(runs):
    warning = (
        "ddpmon: cannot read DeepSpeed's optimizer BF16_Optimizer at ZeRO stage 1: no global "
        "or group gradient norms; local norms, NaN origin, steps and the loss scale are still "
        "measured."
    )
    for rank in (0, 1):
        res = rank_cfg(runs, rank, "z1-bf16-fp32accum")
        assert res["optimizer"] == "BF16_Optimizer"
        assert runs["ranks"][rank]["stderr"].count(warning) == 2  # one per attach (two attaches)
        assert res["steps_total"] == W.STEPS
        assert all(r["grad_norm"] is None for r in res["records"])
        for step, rec in enumerate(res["records"]):
            ref = res["ref_local"][str(step)]
            if finite(ref):
                assert close(float(rec["grad_local_norm"]), ref, LOCAL_REL)
    found = [(r["step"], r["local_nonfinite_param"])
             for r in rank_cfg(runs, W.NAN_RANK, "z1-bf16-fp32accum")["records"] if r["origin"]]
    assert found == [(W.NAN_STEP, W.NAN_PARAM)]


def test_bare_module_before_initialize_warns(runs):
    from ddpmon.strategies.deepspeed.source import BARE_MODULE_WARNING

    for rank in (0, 1):
        assert runs["ranks"][rank]["early_enabled"]  # measured as a plain model, never refused
        # the bare module, attached once per rank outside the configs' loop, and engine.module
        # with the torch optimizer of the ZeRO-0 fp32 configs (not refused, warned)
        plain = [n for n in CONFIGS if n.startswith("z0-fp32")]
        assert runs["ranks"][rank]["stderr"].count(BARE_MODULE_WARNING) == 1 + len(plain)


@pytest.mark.parametrize("name", ["z3-bf16-gas2", "z2-fp16-gas2", "z0-fp32-gas1"])
def test_exposition(runs, name):
    """What a scrape shows: the strategy label, the step count, the last norm, and a loss scale
    only under fp16."""
    from prometheus_client.parser import text_string_to_metric_families

    cfg = CONFIGS[name]
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        samples = {}
        for family in text_string_to_metric_families(res["exposition"]):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
        info = samples["ddpmon_rank_info"][0].labels
        assert info["strategy"] == f"deepspeed-zero{cfg['stage']}"
        assert samples["ddpmon_steps_total"][0].value == W.STEPS
        last = res["records"][-1]["grad_norm"]
        assert close(samples["ddpmon_grad_norm"][0].value, float(last), 1e-9)
        scale = samples.get("ddpmon_amp_loss_scale")
        if cfg["precision"] == "fp16":
            assert scale[0].value == res["ds_scales"][-1]
        else:
            assert scale is None
        skipped = {s.labels["by"]: s.value for s in samples["ddpmon_steps_skipped_total"]}
        by = "scaler" if cfg["precision"] == "fp16" else "engine"
        assert skipped == {by: res["skipped_steps"][-1]}, skipped


def test_one_rank_failing_to_read_its_partitions_hangs_no_rank(runs):
    """Rank 1's reading fails at FAIL_STEP: both ranks still meet in the all-reduce, report 0
    for that step (never NaN) and DeepSpeed's norm on the others; only rank 1 counts it."""
    for rank in (0, 1):
        res = rank_cfg(runs, rank, "z2-fp32-probe-fails")
        assert res["steps_total"] == W.STEPS
        for step, rec in enumerate(res["records"]):
            if step == W.FAIL_STEP:
                assert rec["grad_norm"] == 0.0 and res["ds_norms"][step] > 0
            else:
                assert close(float(rec["grad_norm"]), float(res["ds_norms"][step]), REL)
        assert res["errors"] == ({"grads": 1} if rank == 1 else {})


DS_NAMES = {  # ddpmon op -> the names DeepSpeed's comms_logger records it under
    "all_reduce": ("all_reduce",),
    "reduce": ("reduce",),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter"),
    "all_gather": ("all_gather_into_tensor", "all_gather"),
    "broadcast": ("broadcast",),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_collective_counts_match_deepspeeds_own_logger(runs, name):
    """Every deepspeed.comm collective the engine issued after attach is timed once, under its
    op, exactly as many times as DeepSpeed's comms_logger counted it; the gradient reduction
    is there (all-reduce at stages 0-2, reduce-scatter at stage 3), every mean is positive and
    below the mean step, and bytes are counted."""
    stage = CONFIGS[name]["stage"]
    for rank in (0, 1):
        res = rank_cfg(runs, rank, name)
        theirs = res["ds_comm_counts"]
        ours = res["collective_counts"]
        expected = {
            op: sum(theirs.get(n, 0) for n in names) for op, names in DS_NAMES.items()
        }
        assert ours == {op: n for op, n in expected.items() if n}, (ours, theirs)
        assert set(theirs) <= {n for names in DS_NAMES.values() for n in names}, theirs
        reduction = "reduce_scatter" if stage == 3 else "all_reduce"
        assert ours.get(reduction, 0) >= W.STEPS, ours
        for op, mean in res["collective_means"].items():
            assert 0 < mean < res["step_mean"], (op, mean, res["step_mean"])
            assert res["collective_bytes"][op] > 0
        assert "comm" not in res["errors"]


@pytest.mark.parametrize("name", MEASURED)
def test_identical_batches_are_counted_over_the_data_parallel_group(runs, name):
    """Checked on every step (``data_check_interval=1``). The dupdata configs seed every rank
    alike: a step matches where both ranks' local gradients are finite (rank 1's NaN at
    NAN_STEP, and any step after DeepSpeed applied it, matches nothing). Distinct batches
    never match."""
    r0, r1 = (rank_cfg(runs, rank, name)["records"] for rank in (0, 1))
    assert [r["step"] for r in r0] == [r["step"] for r in r1]
    for a, b in zip(r0, r1, strict=True):
        finite = not a["local_nonfinite"] and not b["local_nonfinite"]
        expected = 1 if CONFIGS[name].get("dupdata") and finite else 0
        assert a["data_identical_ranks"] == b["data_identical_ranks"] == expected, (name, a["step"])
    if CONFIGS[name].get("dupdata"):
        assert sum(r["data_identical_ranks"] for r in r0) >= 1, r0  # not vacuous (step 0)
    manifest = json.loads((Path(rank_cfg(runs, 0, name)["run_path"]) / "manifest.json").read_text())
    assert manifest["data_check"] == {"every": 1, "over": "the engine's data-parallel group"}
