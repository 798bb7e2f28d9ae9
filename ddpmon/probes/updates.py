"""Per-group weight norms, update norms and optimizer moments, measured on the device at sampled
steps, exact under sharding.

Why: a diverging run's loss spike is usually led by one module group whose update grew relative
to its weights (Adam's first moment swinging), long before a NaN. The global gradient norm does
not say which; ``||dw|| / ||w||`` and the moments' norms per group do.

How (one sampled step, every ``every`` steps, default 10):

- the optimizer's step pre-hook copies this rank's pieces of the trainable parameters (a
  DTensor's local shard, a plain tensor as it is): one copy of the local weights, at sampled
  steps only, freed at the post-hook;
- the post-hook measures per parameter, in one fused norm pass each: the weights after the step,
  the update (after - before), and where the optimizer keeps them (Adam, AdamW, ...) the first
  and second moments ``exp_avg`` and ``exp_avg_sq`` of this rank's pieces;
- the squares go into one float64 vector, masked so a replicated piece counts once, and are
  SUMmed over the mesh dims on which parameters are sharded (``dtensor_norms.build_plan``: FSDP2,
  HSDP's shard dim, TP, FSDP2+TP): squared norms add over disjoint shards, nothing is gathered.
  DDP and one process have full replicated parameters: no collective at all;
- the vector joins the step's other device values (``UPDATE_SQUARES`` slot) and is read back
  lazily with them; the record thread folds it per group (``update_stats.group_stats``).

The sampling decision uses the pipeline's step counter, identical on every rank, so the
collective of a sharded model is issued by every rank at the same step. No value is read on the
host: the wait on the small all-reduce is a stream wait under NCCL; on CPU (gloo) it is a
rendezvous with the peers, at sampled steps only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._torch_compat import dtensor_local
from .grads import ParamIndex, per_param_norms

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Optimizer state entries measured where present (the Adam family's first and second moment)."""
DEFAULT_COPY_BUDGET = 1 << 30
"""Bytes the sampled step's weight copy may take (``Config.update_copy_budget_mib``)."""

log = logging.getLogger("ddpmon")


def keeps_moments(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer is of the Adam family (its parameter groups carry ``betas``): decided from
    the optimizer itself, the same on every rank, never from which state a rank holds (a rank
    whose shard has no state yet must still send as many values as its peers)."""
    return any("betas" in group for group in optimizer.param_groups)


def copy_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of the sampled step's copy of this rank's pieces, an upper bound computed from the
    global shapes and placements only, so every rank of a sharded model decides alike."""
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own piece (its ``device_mesh`` says it is one), a plain tensor as it is."""
    return dtensor_local(tensor) if hasattr(tensor, "device_mesh") else tensor


def _pieces(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_local(p).detach() for p in params]


def _plain_pieces(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach() for p in params]


class Reduction(Protocol):
    """What the probe needs of the strategies' reduction plan (``dtensor_norms``)."""

    mask: torch.Tensor
    device: torch.device

    def start(self, vector: torch.Tensor) -> Any:
        """Start the in-place SUM of ``vector`` over the sharded dims; the work, or None."""


class UpdateProbe:
    """Hooks one optimizer; ``take()`` hands the pipeline the sampled step's device vector.

    The vector holds, for the ``n`` indexed parameters in index order, the global squared norms
    of: the weights after the step, the update, then (only when the optimizer keeps them) the
    first and second moments: ``2n`` or ``4n`` values, decided once from the optimizer
    (``keeps_moments``), the same on every rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        index: ParamIndex,
        every: int,
        step_of: Callable[[], int],
        on_error: Callable[[str, BaseException], None],
        reduction: Reduction | None = None,
        copy_budget: int = DEFAULT_COPY_BUDGET,
    ) -> None:
        """``reduction``: the sum over the mesh dims of a sharded model (None: the parameters
        are full and replicated, nothing is communicated). ``copy_budget``: the bytes the weight
        copy may take; a larger copy is never made (the samples are skipped, counted in
        ``skipped``, logged once), so the probe cannot push training out of memory."""
        if every < 1:
            raise ValueError(f"update sampling interval {every}: expected >= 1")
        self.optimizer = optimizer
        self.index = index
        self.every = every
        self._step_of = step_of
        self._on_error = on_error
        self.plan = reduction
        self.moments = keeps_moments(optimizer)
        self.copy_bytes = copy_bytes(index.params)
        self.copy_budget = copy_budget
        self.skipped = 0
        """Sampled steps not measured: the weight copy would exceed ``copy_budget``."""
        self.sample_next = False
        """Set on the host (a spike was seen): sample the next step too. Honoured only where
        no collective is needed (one process, DDP), since ranks do not agree on when they
        read their records."""
        self._pieces = (_pieces if any(hasattr(p, "device_mesh") for p in index.params)
                        else _plain_pieces)
        """This rank's pieces of the parameters (plain tensors: themselves, decided once)."""
        self._before: list[torch.Tensor] | None = None
        self._result: torch.Tensor | None = None
        self._index_cache: dict[tuple, torch.Tensor] = {}
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]
        self.closed = False

    @property
    def collective(self) -> bool:
        """Sampled steps issue a collective (a sharded model)."""
        return self.plan is not None

    def due(self, step: int) -> bool:
        if step % self.every == 0:
            return True
        return self.sample_next and not self.collective

    def _pre(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if self.closed:
            return
        self._result = None
        self._before = None
        try:
            if not self.due(self._step_of()):
                return
            self.sample_next = False
            if self.copy_bytes > self.copy_budget:
                self._skip()
                return
            with torch.no_grad():
                self._before = [p.clone() for p in self._pieces(self.index.params)]
        except Exception as exc:
            self._before = None
            self._on_error("updates", exc)

    def _skip(self) -> None:
        if self.skipped == 0:
            log.warning(
                "ddpmon: update figures skipped: the sampled step's weight copy would take "
                "%.1f MiB, over update_copy_budget_mib=%.1f (raise it, or set update_every=0)",
                self.copy_bytes / 2**20, self.copy_budget / 2**20)
        self.skipped += 1

    def _post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        before, self._before = self._before, None
        if self.closed or before is None:
            return
        try:
            with torch.no_grad():
                self._result = self._measure(before)
        except Exception as exc:
            self._result = None
            self._on_error("updates", exc)

    def _measure(self, before: Sequence[torch.Tensor]) -> torch.Tensor:
        params = self.index.params
        after = self._pieces(params)
        # our copies: the update in place, w_before - w_after (its norm, the sign aside); one
        # foreach call, the same elementwise subtraction as a sub_ per tensor
        if after:
            torch._foreach_sub_(list(before), after)
        # weights and updates in one norm pass: each tensor's norm is its own reduction, the
        # same bits as two passes, in half the calls and without a concatenation
        vector = per_param_norms([*after, *before]).to(dtype=torch.float64)
        device = vector.device
        parts = 2
        if self.moments:
            moments = self._moments(params, device)
            vector = torch.cat([vector, *moments])
            parts += 2
        vector = vector * vector
        if self.plan is None:
            return vector
        vector = vector.to(self.plan.device) * self.plan.mask.repeat(parts)
        work = self.plan.start(vector)
        if work is not None:
            work.wait()  # a stream wait under NCCL; gloo: the peers' share, sampled steps only
        return vector

    def _moments(self, params: Sequence[torch.Tensor], device: torch.device) -> list:
        """Norms of each moment per parameter (zeros where a parameter has no state here)."""
        state = self.optimizer.state
        found = []
        for name in MOMENTS:
            where, tensors = [], []
            for i, p in enumerate(params):
                entry = state.get(p)
                value = entry.get(name) if isinstance(entry, dict) else None
                if isinstance(value, torch.Tensor) and value.numel() > 0:
                    where.append(i)
                    tensors.append(_local(value).detach())
            found.append((where, tensors))
        if all(len(where) == len(params) for where, _ in found):  # the usual step: all state
            both = [t for _, tensors in found for t in tensors]  # one norm pass for both
            return [per_param_norms(both).to(device=device, dtype=torch.float64)]
        out = []
        for where, tensors in found:
            if len(where) == len(params):
                out.append(per_param_norms(tensors).to(device=device, dtype=torch.float64))
                continue
            norms = torch.zeros(len(params), dtype=torch.float64, device=device)
            if where:
                measured = per_param_norms(tensors).to(device=device, dtype=torch.float64)
                norms.index_copy_(0, self._positions(where, device), measured)
            out.append(norms)
        return out

    def _positions(self, where: list[int], device: torch.device) -> torch.Tensor:
        """``where`` as a device index, copied to the device once per distinct set (a host to
        device copy each step would be one more transfer on the hot path)."""
        key = (tuple(where), str(device))
        index = self._index_cache.get(key)
        if index is None:
            if len(self._index_cache) >= 8:  # bounded: states appear once, then stay
                self._index_cache.clear()
            index = torch.tensor(where, dtype=torch.long)
            if device.type == "cuda":  # pinned and non-blocking: no wait for the stream
                index = index.pin_memory()
            index = self._index_cache[key] = index.to(device, non_blocking=True)
        return index

    def take(self) -> torch.Tensor | None:
        """The sampled step's device vector (None: not sampled), cleared for the next step."""
        result, self._result = self._result, None
        return result

    def close(self) -> None:
        self.closed = True
        self._before = self._result = None
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()


__all__ = ["DEFAULT_COPY_BUDGET", "MOMENTS", "UpdateProbe", "copy_bytes", "keeps_moments"]
