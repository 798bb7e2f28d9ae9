"""Where a NaN entered a rank (strategies/block_entry.py): per step, which top-level blocks'
output gradients were non-finite, as autograd went on with them (after any hook on the tensor,
registered before or after ddpmon's), and the block nearest the loss among them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddpmon.metrics.state import StepRecord
from ddpmon.strategies.block_entry import BlockEntry, tensor_parallel, top_level_blocks


class Net(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.body.layers:
            h = h + block(h)
        return self.head(h).sum()


def _poison(model: Net, layer: int):
    """The NaN a test puts into a block's output gradient, as test_torchtitan's harness does."""
    def hook(_module, _args, output):
        output.register_hook(lambda g: torch.full_like(g, math.nan))

    return model.body.layers[layer].register_forward_hook(hook)


def _errors():
    seen: list[tuple[str, BaseException]] = []
    return seen, lambda probe, exc: seen.append((probe, exc))


@pytest.mark.parametrize("poison_before_install", [False, True])
def test_the_block_whose_output_gradient_went_non_finite_first_is_named(poison_before_install):
    torch.manual_seed(0)
    model = Net()
    errors, on_error = _errors()
    if poison_before_install:
        _poison(model, 2)
    entry = BlockEntry.install(model, on_error)
    if not poison_before_install:
        _poison(model, 2)
    model(torch.randn(3, 6)).backward()
    flags = entry.take()
    assert flags is not None and flags.dtype == torch.float32
    assert [not math.isfinite(v) for v in flags.tolist()] == [True, True, True, False]
    assert entry.first(flags.tolist()) == ("body.layers.2", 1)
    assert errors == []
    assert entry.take() is None  # taken: the next step starts afresh


def test_a_finite_step_has_no_entry_and_micro_steps_accumulate():
    model = Net()
    entry = BlockEntry.install(model, _errors()[1])
    model(torch.randn(3, 6)).backward()
    flags = entry.take()
    assert all(math.isfinite(v) for v in flags.tolist()) and entry.first(flags.tolist()) is None
    poison = _poison(model, 3)
    model(torch.randn(3, 6)).backward()  # a NaN micro-step, then a finite one: still flagged
    poison.remove()
    model(torch.randn(3, 6)).backward()
    assert entry.first(entry.take().tolist()) == ("body.layers.3", 0)


def test_no_grad_forwards_register_nothing_and_close_removes_the_hooks():
    model = Net()
    entry = BlockEntry.install(model, _errors()[1])
    with torch.no_grad():
        model(torch.randn(3, 6))
    assert entry.take() is None
    entry.close()
    _poison(model, 1)
    model(torch.randn(3, 6)).backward()
    assert entry.take() is None


def test_mark_puts_the_entry_only_on_a_non_finite_record():
    entry = BlockEntry.install(Net(), _errors()[1])
    record = StepRecord(step=0, wall_time=0.0, duration_seconds=None, data_wait_seconds=None)
    nan = math.nan
    entry.mark(record, [nan, nan, 0.0, 0.0])
    assert record.entry_block is None
    record.local_nonfinite = True
    entry.mark(record, [nan, -math.inf, 0.0, 1e30])
    assert (record.entry_block, record.entry_depth) == ("body.layers.1", 2)
    entry.mark(record, [nan])  # a width that is not this model's: no entry made up
    assert (record.entry_block, record.entry_depth) == ("body.layers.1", 2)


def test_top_level_blocks_and_the_strategies_it_runs_under():
    assert [n for n, _ in top_level_blocks(Net(blocks=3))] == [
        "body.layers.0", "body.layers.1", "body.layers.2"]
    titan_like = nn.Module()
    titan_like.tok = nn.Embedding(4, 2)
    titan_like.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(3)})
    assert [n for n, _ in top_level_blocks(titan_like)] == ["layers.0", "layers.1", "layers.2"]
    assert top_level_blocks(nn.Linear(2, 2)) == []
    stem_first = nn.Module()  # a short stem before the blocks: the larger container wins
    stem_first.stem = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    stem_first.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3))
    assert [n for n, _ in top_level_blocks(stem_first)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in top_level_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))] == [
        "0", "1"]
    assert BlockEntry.install(nn.Linear(2, 2), _errors()[1]) is None
    assert [s for s in ("plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "hsdp+tp")
            if tensor_parallel(s)] == ["tp", "fsdp2+tp", "hsdp+tp"]


def test_compiled_blocks_train_on():
    """``module.compile(fullgraph=True)`` traces the module's hooks: the check stays out of the
    trace (a grad_fn hook there fails the compile). ``torch.compile(block)`` put in the block's
    place (torchtitan's way) runs the hooks outside the compiled forward: still checked."""
    torch.manual_seed(0)
    in_place = Net(blocks=3)
    errors, on_error = _errors()
    entry = BlockEntry.install(in_place, on_error)
    for block in in_place.body.layers:
        block.compile(backend="eager", fullgraph=True)
    in_place(torch.randn(3, 6)).backward()
    assert entry.take() is None and errors == []
    wrapped = Net(blocks=3)
    for k, block in enumerate(wrapped.body.layers):
        wrapped.body.layers[k] = torch.compile(block, backend="eager", fullgraph=True)
    entry = BlockEntry.install(wrapped, on_error)
    _poison(wrapped, 1)
    wrapped(torch.randn(3, 6)).backward()
    assert entry.first(entry.take().tolist()) == ("body.layers.1", 1) and errors == []
