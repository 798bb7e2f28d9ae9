"""Observed values (the loss, a trainer's norm) as a plain tensor the step vector can read back.

A DTensor is read as the value the user means, its full value, and never with a collective (one
on the training thread every step would be a new collective per step, and would hang a loop that
observes its loss on one rank only):

- every placement ``Replicate`` (torchtitan's loss under loss-parallel TP, ``full_dtensor``), or
  ``Partial``/``Shard`` only on mesh dimensions of size 1 (a one-rank sharding mesh beside TP): the
  local tensor is the full value (``to_local()``, a view, no copy, no communication);
- a **loss** that is ``Partial`` (``sum`` or ``avg``) over more than one rank: each rank records
  its *share*, its local piece times the size of every ``sum`` dimension, so that the mean of
  the shares over the ranks holding it is exactly the full value. For ``avg`` (a loss averaged
  over data-parallel ranks, torchtitan's ``full_dtensor`` mode) the share is the rank's own
  loss, what a DDP rank records; for ``sum`` of per-rank means divided by the world it is the
  same. The full value is assembled where the ranks meet, with no collective: ``ddpmon compare``
  and ``report`` average the loss over ranks, and so do the dashboards' run lines. The share is
  one device multiply on the training thread, read back lazily with the step;
- a one-element value ``Shard``-ed over more than one rank: the rank holding the element records
  it; the others hold none of it and record no loss for the step (not an error);
- anything else over more than one rank (``Partial`` with ``max``/``min``, a norm's
  ``_NormPartial``, whose full value is not linear in the pieces, and any trainer norm that is
  not whole on every rank, since the cross-check compares one rank's full norm) is dropped
  alone, counted under its probe (``ddpmon_agent_errors_total{probe="loss"}``) and logged once
  with the fix: hand over ``value.full_tensor()`` (what the trainer logs anyway) or a
  ``Replicate`` value.

Any other tensor subclass is kept as it is and read with the step's other values; one that
cannot be read there is dropped alone (``StepVectorLayout.pack``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..strategies.dtensor_norms import is_dtensor

log = logging.getLogger("ddpmon")

LINEAR_OPS = ("sum", "avg")
"""``Partial`` reductions whose full value is linear in the ranks' pieces."""


class UnreadableValue(ValueError):
    """An observed value whose full value would need a collective (dropped and counted)."""


def plain(value: torch.Tensor, *, shares: bool = False) -> torch.Tensor | None:
    """``value`` detached, as a plain tensor holding its full value, or, with ``shares`` (a
    loss), this rank's share of a linear ``Partial`` one (see the module docstring). None: a
    ``Shard``-ed one-element value another rank holds. Training thread: no device read, no
    collective. Raises ``UnreadableValue`` when no rank-local value can stand for it."""
    value = value.detach()
    if type(value) is torch.Tensor or not is_dtensor(value):
        return value
    scale = _share_scale(value, shares)
    local = value.to_local()
    if local.numel() == 0:
        return None
    return local if scale == 1 else local * scale


def _share_scale(value: Any, shares: bool) -> int:
    """What this rank's local piece is multiplied by to be its share (1: the full value)."""
    mesh = value.device_mesh
    scale, shared = 1, False
    for dim, placement in enumerate(value.placements):
        size = mesh.size(dim)
        if placement.is_replicate() or size == 1:
            continue
        if placement.is_shard() and value.numel() == 1:
            continue  # the one element lives on one rank: its local piece is the full value
        op = reduce_op_name(placement) if placement.is_partial() else None
        if not shares or op not in LINEAR_OPS:
            raise UnreadableValue(
                f"a DTensor with placement {placement} over {size} ranks (mesh dim {dim}): "
                "its full value needs a collective, which ddpmon does not run on the training "
                "thread; hand over value.full_tensor() or a Replicate DTensor"
            )
        shared = True
        if op == "sum":
            scale *= size
    if shared:
        _note_share(value, scale)
    return scale


def reduce_op_name(placement: Any) -> str:
    """A ``Partial`` placement's reduction as a name (``sum``, ``avg``, ``max``...); a norm's
    ``_NormPartial`` (its pieces combine as a p-norm, not linearly) is ``norm``."""
    if hasattr(placement, "norm_type"):
        return "norm"
    op = getattr(placement, "reduce_op", "sum")
    return op if isinstance(op, str) else str(getattr(op, "name", op)).lower()


_noted: set[tuple] = set()


def _note_share(value: Any, scale: int) -> None:
    """Say once per placement what the rank records (a host fact, no device access)."""
    key = (tuple(str(p) for p in value.placements), tuple(value.device_mesh.shape), scale)
    if key in _noted:
        return
    _noted.add(key)
    log.info(
        "ddpmon: the observed loss is a DTensor %s on a %s mesh; each rank records its share "
        "(its local piece x %d), and the full loss is the mean of the shares over the ranks "
        "(ddpmon compare, report and the dashboards' run lines take that mean)",
        [str(p) for p in value.placements], tuple(value.device_mesh.shape), scale,
    )
