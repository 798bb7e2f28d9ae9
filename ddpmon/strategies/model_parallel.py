"""How many ranks split one replica of a DTensor model (tensor parallel, alone or under FSDP2 or
HSDP), and so train on the same batch: read from the parameters' placements (host metadata, no
collective) for ``GradientSource.batch_share``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .dtensor_norms import is_dtensor, is_sharded


def split_degree(params: Iterable[Any], data_dims: int = 0) -> int:
    """Per device mesh, the product of the sizes of the dims, after the first ``data_dims``
    (FSDP2's data-parallel dims: 1, HSDP's: 2), on which some parameter is sharded; the largest
    over the meshes, 1 without DTensor parameters. Dims where every parameter is replicated
    split nothing, so their ranks read batches of their own."""
    meshes: dict[int, tuple[Any, set[int]]] = {}
    for p in params:
        if not is_dtensor(p):
            continue
        _, dims = meshes.setdefault(id(p.device_mesh), (p.device_mesh, set()))
        dims.update(d for d, pl in enumerate(p.placements) if d >= data_dims and is_sharded(pl))
    return max((math.prod(mesh.size(d) for d in dims) for mesh, dims in meshes.values()),
               default=1)
