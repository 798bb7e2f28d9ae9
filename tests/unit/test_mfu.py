"""FLOPs per step and MFU on a real monitor: ``mon.count_flops`` counts one training step of a
dense transformer, a GQA + sliding-window attention model and a small MoE as
``FlopCounterMode`` counts the same step run without ddpmon (gradient accumulation: the micro-
batches add up); /metrics serves MFU = FLOPs x steps/s / peak; an impossible MFU (a peak set too
low) is refused with one message and never exported; a batch that several ranks train on (TP
peers, pipeline stages) gives each its share of the tokens."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from ddpmon.flops.auto import activation_count, leading_count
from ddpmon.flops.mfu import Throughput
from ddpmon.flops.peaks import dtype_of_precision, lookup
from tests.support.flop_models import batch, build, reference_count
from tests.support.scrape import scrape
from tests.support.served import served_monitors


def make_step(model, opt, micro_batches: int = 1, step: int = 0):
    def run():
        for k in range(micro_batches):
            model(batch(step * 10 + k)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return run


def reference_flops(model, micro_batches: int = 1, attention: bool = True) -> int:
    """FlopCounterMode's own count of the same step, on a copy of the model without ddpmon."""
    return reference_count(model, lambda plain, opt: make_step(plain, opt, micro_batches)(),
                           attention)


@pytest.fixture
def attached(tmp_path):
    yield from served_monitors(tmp_path)


@pytest.mark.parametrize("kind", ["dense", "gqa_swa", "moe"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_counted_flops_match_flop_counter_mode(attached, kind, micro_batches):
    model = build(kind)
    want = reference_flops(model, micro_batches)
    mon, opt, port = attached(model)
    mon.count_flops(make_step(model, opt, micro_batches))
    assert want > 0
    assert mon.flops_per_step == pytest.approx(want, rel=0.02)
    assert scrape(port)[("ddpmon_flops_per_step", ())] == mon.flops_per_step


def test_gqa_sliding_window_attention_is_counted_with_its_kv_heads():
    """The attention itself (4 query heads over 2 key/value heads, masked to a window) counts
    as torch's SDPA formula says, forward and backward; without the CPU formulas it is 0."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from tests.support.flop_models import DIM, SEQ

    model = build("gqa_swa")
    q, kv, out = (2, 4, SEQ, DIM // 4), (2, 2, SEQ, DIM // 4), (2, 4, SEQ, DIM // 4)
    attention = sdpa_flop_count(q, kv, kv) + sdpa_backward_flop_count(out, q, kv, kv)
    assert reference_flops(model) - reference_flops(model, attention=False) == attention > 0


def test_gradient_accumulation_counts_every_micro_batch():
    model = build("dense")
    assert reference_flops(model, 2) == pytest.approx(2 * reference_flops(model, 1), rel=0.02)


def test_mfu_with_a_given_peak_is_flops_times_steps_per_second_over_peak(attached):
    model = build("dense")
    peak = 1e12
    mon, opt, port = attached(model, peak_flops=peak, tokens_per_step=2 * 16)
    mon.count_flops(make_step(model, opt))
    t0 = time.time()  # the rates run from the count: steps/s by the test's own clock
    for step in range(1, 21):
        time.sleep(0.005)
        make_step(model, opt, step=step)()
    elapsed = time.time() - t0
    mon.flush()
    m = scrape(port)
    flops, mfu = m[("ddpmon_achieved_flops", ())], m[("ddpmon_mfu_ratio", ())]
    assert mfu == pytest.approx(flops / peak, rel=1e-9)
    assert flops == pytest.approx(mon.flops_per_step * 20 / elapsed, rel=0.05)
    assert m[("ddpmon_tokens_per_second", ())] == pytest.approx(32 * 20 / elapsed, rel=0.05)
    assert m[("ddpmon_peak_flops", ())] == peak


def test_an_impossible_mfu_is_refused_once_and_not_exported(attached, caplog):
    model = build("dense")
    mon, opt, port = attached(model, peak_flops=1.0)  # one FLOP/s: any step beats it
    mon.count_flops(make_step(model, opt))
    for step in range(1, 4):
        make_step(model, opt, step=step)()
    mon.flush()
    with caplog.at_level(logging.WARNING, logger="ddpmon.mfu"):
        first, second = scrape(port), scrape(port)
    for m in (first, second):
        assert ("ddpmon_mfu_ratio", ()) not in m
        assert m[("ddpmon_achieved_flops", ())] > 1.0  # the rate itself is real
    refusals = [r for r in caplog.records if "impossible" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]


def test_the_peak_table_knows_the_devices_by_dtype():
    assert lookup("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4e12)
    assert lookup("NVIDIA H100 PCIe", "torch.bfloat16")[0] == pytest.approx(756e12)
    assert lookup("NVIDIA H200", "fp8")[0] == pytest.approx(1978.9e12)
    assert lookup("NVIDIA A100-SXM4-80GB", "tf32")[0] == pytest.approx(156e12)
    assert lookup("NVIDIA B200", "bf16")[0] == pytest.approx(2250e12)
    assert lookup("AMD Instinct MI300X", "fp16")[0] == pytest.approx(1307.4e12)
    assert lookup("NVIDIA GeForce RTX 4090", "bf16") is None
    assert lookup("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on A100
    assert dtype_of_precision("amp-bf16+gradscaler") == "bf16"
    assert dtype_of_precision("deepspeed-fp16") == "fp16"


def test_a_shared_batch_gives_each_rank_its_share_of_the_tokens():
    progress = [(0, 0.0)]
    t = Throughput({}, lambda: progress[-1], tokens_shared_by=4)
    t.set(tokens_per_step=64, settle=True)  # 64 tokens read, 4 ranks train on them
    progress.append((1, 100.0))
    assert t.rates() == {}  # the baseline
    progress.append((5, 102.0))
    rates = t.rates()
    assert rates["steps_per_second"] == 2.0
    assert rates["tokens_per_second"] == 64 / 4 * 2.0
    assert t.tokens_per_step == 64  # as read


def test_a_later_stage_counts_the_tokens_of_the_activations_it_is_given():
    ids = torch.zeros(2, 16, dtype=torch.long)
    assert activation_count((torch.zeros(2, 16, 32),), {}) == leading_count((ids,), {}) == 32
    assert activation_count((torch.zeros(8, 32),), {}) == 8  # [batch, features]: samples
    assert activation_count((), {"h": torch.zeros(3, 5, 7)}) == 15
    assert activation_count((), {}) == 0
