"""Observed values (the loss, a trainer's norm) as a plain tensor the step vector can read back.

A DTensor is read as the value the user means, its full value, without a collective:

- every placement ``Replicate`` (torchtitan's loss under loss-parallel TP, ``full_dtensor``):
  the local tensor is the full value (``to_local()``, a view, no copy, no communication);
- ``Partial`` or ``Shard`` only on mesh dimensions of size 1 (a one-rank sharding mesh beside TP):
  the local tensor is the full value too;
- ``Partial`` or ``Shard`` over more than one rank: the full value is a sum over the other ranks.
  ddpmon does not reduce it: that is a collective on the training thread every step, and no
  norm reduction can carry it (they are issued when backward ends, before the loss is usually
  handed over). The value is dropped alone, counted under its probe
  (``ddpmon_agent_errors_total{probe="loss"}``) and logged once with the fix: hand over
  ``loss.full_tensor()`` (what the trainer logs anyway) or a ``Replicate`` loss.

Any other tensor subclass is kept as it is and read with the step's other values; one that
cannot be read there is dropped alone (``StepVectorLayout.pack``).
"""

from __future__ import annotations

import torch

from ..strategies.dtensor_norms import is_dtensor


class UnreadableValue(ValueError):
    """An observed value whose full value would need a collective (dropped and counted)."""


def plain(value: torch.Tensor) -> torch.Tensor:
    """``value`` detached, as the tensor holding its full value. Training thread: no device read,
    no collective. Raises ``UnreadableValue`` when the full value is spread over ranks."""
    value = value.detach()
    if type(value) is torch.Tensor or not is_dtensor(value):
        return value
    mesh = value.device_mesh
    for dim, placement in enumerate(value.placements):
        if placement.is_replicate() or mesh.size(dim) == 1:
            continue
        raise UnreadableValue(
            f"a DTensor with placement {placement} over {mesh.size(dim)} ranks (mesh dim "
            f"{dim}): its full value needs a collective, which ddpmon does not run on the "
            "training thread; hand over value.full_tensor() or a Replicate DTensor"
        )
    return value.to_local()

