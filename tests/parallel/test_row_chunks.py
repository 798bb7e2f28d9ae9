"""The per-parameter norms over a reduce-scatter input equal the norms of the parameters'
gradients it was built from, on the sliced, the strided and the precomputed CPU path, NaN
included."""

from __future__ import annotations

import pytest
import torch

from ddpmon.strategies.fsdp import comms as fsdp_comms
from ddpmon.strategies.fsdp import flat_norms
from ddpmon.strategies.fsdp.shard_norms import ShardPass


def _input(grads: list[torch.Tensor], world: int) -> tuple[torch.Tensor, list[int]]:
    """FSDP2's layout: row r holds every parameter's r-th dim-0 chunk, zero-padded."""
    chunks, columns = [], []
    for g in grads:
        rows = -(-g.shape[0] // world)
        padded = torch.zeros((rows * world, *g.shape[1:]))
        padded[: g.shape[0]] = g
        chunks.append(padded.reshape(world, -1))
        columns.append(chunks[-1].shape[1])
    return torch.cat(chunks, dim=1).reshape(-1), columns


@pytest.mark.parametrize("max_slices", [512, 1])
def test_row_chunk_norms_match_the_gradients(monkeypatch, max_slices):
    monkeypatch.setattr(fsdp_comms, "_MAX_SLICES", max_slices)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen), torch.randn(2, 2)]
    flat, columns = _input(grads, world=4)
    norms = fsdp_comms.row_chunk_norms(flat, 4, columns)
    expected = torch.stack([g.double().norm() for g in grads])
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)
    grads[1][6] = float("nan")
    flat, columns = _input(grads, world=4)
    norms = fsdp_comms.row_chunk_norms(flat, 4, columns)
    assert torch.isnan(norms[1]) and torch.isfinite(norms[[0, 2]]).all()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_flat_layout_matches_the_gradients(world):
    """The precomputed CPU pass: large chunks on the global row grid, their shared rows and the
    small chunks element by element; every element counted once, float64 exact enough."""
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(300, 40, generator=gen), torch.randn(3, generator=gen),
             torch.randn(9001, generator=gen) * 1e3, torch.randn(257, 33, generator=gen),
             torch.randn(1, generator=gen)]
    flat, columns = _input(grads, world)
    layout = flat_norms.build_layout(world, columns, flat.device)
    expected = torch.stack([g.double().norm() for g in grads])
    torch.testing.assert_close(layout.norms(flat), expected, rtol=1e-6, atol=0)
    counted = layout.norms(torch.ones_like(flat)).square()
    torch.testing.assert_close(counted, torch.tensor([float(world * c) for c in columns],
                                                     dtype=torch.float64), rtol=0, atol=1e-6)
    bf16 = flat.to(torch.bfloat16)
    torch.testing.assert_close(layout.norms(bf16), fsdp_comms.row_chunk_norms(bf16, world, columns),
                               rtol=1e-5, atol=0)


def test_unit_norms_measures_a_nonfinite_input_again():
    """A float32 row that overflows is measured again in float64; a NaN stays a NaN where it
    is and nowhere else."""
    grads = [torch.full((600, 30), 1e30), torch.randn(5)]
    flat, columns = _input(grads, world=2)
    unit = fsdp_comms.FSDPUnit(positions=[0, 1], columns=columns)
    norms = fsdp_comms.unit_norms(unit, flat, 2)
    torch.testing.assert_close(norms[0], grads[0].double().norm(), rtol=1e-9, atol=0)
    assert unit.layout is not None
    grads[1][2] = float("nan")
    flat, _ = _input(grads, world=2)
    norms = fsdp_comms.unit_norms(unit, flat, 2)
    assert torch.isnan(norms[1]) and torch.isfinite(norms[0])


def test_shard_pass_reads_views_of_one_buffer_and_declines_anything_else():
    """The end-of-backward pass: gradients that are views side by side in one unit buffer (as
    FSDP2 leaves them) are measured from the buffer, the padding between them not counted, in
    index order whatever the units' order; any other layout answers None (general pass)."""
    gen = torch.Generator().manual_seed(3)
    root = torch.randn(300 + 8 + 5, generator=gen)  # unit 0 (positions 2, 3), padded widths
    root[300:308] = 1e6  # padding: never counted
    block = torch.randn(9000 + 40, generator=gen)  # unit 1 (positions 0, 1)
    raw = [block[:9000].view(90, 100), block[9000:9040], root[:300], root[308:313]]
    units = [([2, 3], [308, 5]), ([0, 1], [9000, 40])]
    shard_pass = ShardPass(units, params=4)
    norms = shard_pass([0, 1, 2, 3], raw)
    expected = torch.stack([t.double().norm() for t in raw])
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)
    moved = [raw[0], raw[1].clone(), raw[2], raw[3]]  # a gradient replaced by a copy
    assert shard_pass([0, 1, 2, 3], moved) is None
    assert shard_pass([0, 1, 3], [raw[0], raw[1], raw[3]]) is None  # one without a gradient
    nan = [t.clone() for t in raw]
    block[5] = float("nan")
    assert shard_pass([0, 1, 2, 3], raw) is None  # non-finite: the general pass tells why
    assert ShardPass(units[:1], params=4)([0, 1, 2, 3], nan) is None  # units not covering all
