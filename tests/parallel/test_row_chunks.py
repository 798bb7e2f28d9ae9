"""The per-parameter norms over a reduce-scatter input equal the norms of the parameters'
gradients it was built from, on both the sliced and the strided path, NaN included."""

from __future__ import annotations

import pytest
import torch

from ddpmon.strategies.fsdp import comms as fsdp_comms


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
