"""Where the update probe (``probes.updates``) finds this rank's weights and optimizer moments.

Why apart: the weights an optimizer steps are not always the module's parameters. A torch
optimizer steps the parameters themselves (a DTensor's local shard under FSDP2/TP); DeepSpeed's
ZeRO 1-3 step flat fp32 partitions of which each rank owns a disjoint slice
(``probes.zero_updates``). Both are described the same way here: the *sources* (the tensors the
optimizer steps, copied whole at a sampled step), the *state keys* (what the optimizer's
``state`` is indexed by, one per source) and the *layout*: for each indexed parameter this rank
holds a piece of, the source and the piece's ``(start, numel)`` in it (``None``: the whole
source). The probe measures every piece's weights, update and moments in one fused norm pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._torch_compat import dtensor_local


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own piece (its ``device_mesh`` says it is one), a plain tensor as it is."""
    return dtensor_local(tensor) if hasattr(tensor, "device_mesh") else tensor


@dataclass(frozen=True, slots=True)
class Piece:
    """Parameter ``position`` (in the index) is ``source[start:start + numel]`` of source
    ``source`` (flat), or the whole source where ``start`` is None."""

    position: int
    source: int
    start: int | None = None
    numel: int = 0

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.start is None else tensor.narrow(0, self.start, self.numel)


class Pieces:
    """The torch case: every indexed parameter is its own source (its local piece), looked up
    in ``optimizer.state`` by the parameter. Subclassed for DeepSpeed's flat partitions."""

    def __init__(self, optimizer: Any, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.layout = [Piece(i, i) for i in range(len(self.params))]
        self.moments = keeps_moments(optimizer)

    def sources(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, as they are now (read at every sample: an
        optimizer's state can be rebuilt, e.g. by a checkpoint load)."""
        # a plain Parameter's ``.data``: the same storage without a dispatched op (two sixteen-op
        # passes a sampled step on a small model); its version counter is not shared, and
        # nothing here writes to a source
        return [p.data if type(p) is torch.nn.Parameter else local(p).detach()
                for p in self.params]

    def state(self) -> tuple[Any, list[Any]]:
        """(the optimizer's ``state`` mapping, the key of each source in it)."""
        return self.optimizer.state, self.params

    def copy_bytes(self) -> int:
        """Bytes of a sampled step's copy of the sources, an upper bound computed from the
        global shapes and placements only, so every rank of a sharded model decides alike."""
        return copy_bytes(self.params)


def keeps_moments(optimizer: Any) -> bool:
    """The optimizer is of the Adam family (its parameter groups carry ``betas``): decided from
    the optimizer itself, the same on every rank, never from which state a rank holds (a rank
    whose shard has no state yet must still send as many values as its peers)."""
    return any("betas" in group for group in getattr(optimizer, "param_groups", ()))


def copy_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of this rank's pieces of ``params``, an upper bound from the global shapes and
    placements (a DTensor's largest chunk on each sharded dim)."""
    total = 0
    for p in params:
        shape = list(p.shape)
        mesh = getattr(p, "device_mesh", None)
        for dim, placement in enumerate(getattr(p, "placements", ()) if mesh is not None else ()):
            shard_dim = getattr(placement, "dim", None)
            if isinstance(shard_dim, int) and shape:
                shape[shard_dim] = -(-shape[shard_dim] // mesh.size(dim))  # the largest chunk
        total += math.prod(shape) * p.element_size()
    return total


__all__ = ["Piece", "Pieces", "copy_bytes", "keeps_moments", "local"]
