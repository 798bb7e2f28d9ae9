"""FLOPs per step counted automatically (``flops_count_step``): a plain training loop, no
``mon.count_flops``, gets the FlopCounterMode count of one of its steps (micro-batches added up),
its tokens or samples from the batch, a recount when the batch's shapes change (a cached count
when they change back, at most ``recounts`` recounts), nothing counted from an evaluation
forward after the counted step, a user's dispatch mode left in place, and a failure counted,
never raised."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddpmon.flops import auto as auto_module
from tests.support.flop_models import DIM, build, reference_count
from tests.support.scrape import scrape
from tests.support.served import served_monitors

AT = 3  # the process's 4th training step is counted


def batch(step: int, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, seq, DIM, generator=g)


def train_step(model, opt, step: int, micro_batches: int = 1, seq: int = 16) -> None:
    for k in range(micro_batches):
        model(batch(step * 10 + k, seq)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def reference(model, step: int, micro_batches: int = 1, seq: int = 16) -> int:
    """FlopCounterMode's own count of the same step on a copy without ddpmon."""
    return reference_count(
        model, lambda plain, opt: train_step(plain, opt, step, micro_batches, seq))


@pytest.fixture
def attached(tmp_path):
    yield from served_monitors(tmp_path)


@pytest.mark.parametrize("kind", ["dense", "gqa_swa", "moe"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_plain_loop_gets_the_flops_of_one_step(attached, kind, micro_batches):
    model = build(kind)
    want = reference(model, AT, micro_batches)
    mon, opt, port = attached(model)
    for step in range(AT + 1):
        train_step(model, opt, step, micro_batches)
        assert mon.flops_per_step is None  # warm-up, then the counted step still open
    train_step(model, opt, AT + 1, micro_batches)  # its first forward closes the count
    assert want > 0
    assert mon.flops_per_step == pytest.approx(want, rel=0.02)
    mon.flush()
    scrape(port)  # the rates' baseline: a step read back after the count
    for step in range(AT + 2, AT + 6):
        train_step(model, opt, step, micro_batches)
    mon.flush()
    m = scrape(port)
    assert m[("ddpmon_flops_per_step", ())] == mon.flops_per_step
    assert m[("ddpmon_tokens_per_second", ())] > 0  # 2 samples per micro-batch, from the batch
    assert mon.throughput.tokens_per_step == 2 * micro_batches


def test_token_ids_passed_by_keyword_count_batch_times_sequence(attached):
    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, DIM), nn.Linear(DIM, 50)

        def forward(self, input_ids=None):
            return self.head(self.emb(input_ids))

    model = Lm()
    mon, opt, _ = attached(model, flops_count_step=1)
    for step in range(3):
        ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert mon.throughput.tokens_per_step == 4 * 8
    assert mon.flops_per_step > 0


def test_new_shapes_are_counted_again_and_known_ones_take_their_cached_count(attached, caplog):
    model = build("dense")
    want8, want6 = reference(model, 10, seq=8), reference(model, 26, seq=6)
    mon, opt, _ = attached(model)
    for step in range(AT + 2):
        train_step(model, opt, step)
    short = mon.flops_per_step
    train_step(model, opt, 10, seq=8)  # new shape: counted on this step
    train_step(model, opt, 11, seq=8)
    assert mon.flops_per_step == pytest.approx(want8, rel=0.02)
    assert mon.flops_per_step < short
    train_step(model, opt, 12)  # back to 16: the cached count, no step under the mode
    assert mon.flops_per_step == short
    assert mon.flops_auto._mode is None and len(mon.flops_auto.cache) == 2
    with caplog.at_level(logging.WARNING, logger="ddpmon.mfu"):
        for seq in (4, 5, 6, 7, 9, 10, 11):  # 4 recounts in all, then the last count is kept
            train_step(model, opt, 20 + seq, seq=seq)
            train_step(model, opt, 40 + seq, seq=seq)
    assert len(mon.flops_auto.cache) == 5
    assert mon.flops_per_step == pytest.approx(want6, rel=0.02)
    stops = [r.getMessage() for r in caplog.records if "counting stopped" in r.getMessage()]
    assert len(stops) == 1 and "4 recounts" in stops[0], stops


def test_an_evaluation_right_after_the_counted_step_is_not_counted(attached):
    model = build("dense")
    want = reference(model, AT)
    mon, opt, _ = attached(model)
    for step in range(AT + 1):
        train_step(model, opt, step)
    with torch.no_grad():  # the loop evaluates after step AT: the count closes first
        for k in range(5):
            model(batch(100 + k, seq=64))
    assert mon.flops_per_step == pytest.approx(want, rel=0.02)


def test_a_users_dispatch_mode_open_across_the_step_end_stays_open(attached):
    class Seen(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops += 1
            return func(*args, **(kwargs or {}))

    model = build("dense")
    want = reference(model, AT)
    mon, opt, _ = attached(model)
    for step in range(AT + 1):
        train_step(model, opt, step)
    with Seen():  # entered above the counter's mode, still open at the next forward
        train_step(model, opt, AT + 1)
        before = Seen.ops
        torch.ones(2) + 1
        assert Seen.ops > before  # the user's mode still sees ops
    assert mon.flops_per_step == pytest.approx(want, rel=0.02)
    assert mon.flops_auto._mode is None


def test_a_failure_is_counted_never_raised_and_training_goes_on(attached, monkeypatch):
    def broken():
        raise RuntimeError("no counter here")

    monkeypatch.setattr(auto_module, "flop_counter", broken)
    model = build("dense")
    mon, opt, port = attached(model)
    for step in range(AT + 3):
        train_step(model, opt, step)
    mon.flush()
    assert mon.flops_per_step is None
    assert scrape(port)[("ddpmon_agent_errors_total", (("probe", "mfu"),))] == 1


@pytest.mark.parametrize("options", [{"flops_count_step": 0}, {"flops_per_step": 1e6}])
def test_off_or_given_flops_are_never_counted(attached, options):
    model = build("dense")
    mon, opt, _ = attached(model, **options)
    for step in range(AT + 3):
        train_step(model, opt, step)
    assert mon.flops_per_step is None and mon.flops_auto is None


def test_count_flops_by_hand_still_works_and_ends_the_automatic_count(attached):
    model = build("dense")
    mon, opt, _ = attached(model)
    train_step(model, opt, 0)
    mon.count_flops(lambda: train_step(model, opt, 1))
    counted = mon.flops_per_step
    for step in range(2, AT + 4):
        train_step(model, opt, step, seq=8)  # other shapes: no automatic recount
    assert mon.flops_per_step == counted
