"""Per-group weight norms, update norms and optimizer moments, measured on the device at sampled
steps, exact under sharding.

Why: a diverging run's loss spike is usually led by one module group whose update grew relative
to its weights (Adam's first moment swinging), long before a NaN. The global gradient norm does
not say which; ``||dw|| / ||w||`` and the moments' norms per group do.

How (one sampled step, every ``every`` steps, default 10):

- before the optimizer steps, the probe copies the *sources* (``probes.update_pieces``): the
  tensors the optimizer steps on this rank. A torch optimizer steps the parameters (a DTensor's
  local shard, a plain tensor as it is; its step hooks call the probe); DeepSpeed ZeRO 1-3 step
  flat fp32 partitions, this rank's disjoint slice of the model (``probes.zero_updates`` wraps
  the ZeRO optimizer's ``step``). One copy, at sampled steps only, freed after the step;
- after the step: the copies become the update in place (one fused subtraction), then ONE fused
  norm pass measures every piece's weights, update and, where the optimizer keeps them (Adam,
  AdamW, ...), first and second moments ``exp_avg`` and ``exp_avg_sq``;
- the squares go into one float64 vector, masked so a replicated piece counts once, and are
  SUMmed over the mesh dims on which parameters are sharded (``dtensor_norms.build_plan``: FSDP2,
  HSDP's shard dim, TP, FSDP2+TP) or over DeepSpeed's data-parallel group (ZeRO 1-3): squared
  norms add over disjoint shards, nothing is gathered. DDP, one process and a pipeline stage
  with full parameters: no collective at all (each stage measures the groups it holds);
- the vector joins the step's other device values (``UPDATE_SQUARES`` slot) and is read back
  lazily with them; the record thread folds it per group (``update_stats.group_stats``).

The sampling decision uses the pipeline's step counter, identical on every rank, so the
collective of a sharded model is issued by every rank at the same step. No value is read on the
host: the wait on the small all-reduce is a stream wait under NCCL; on CPU (gloo) it is a
rendezvous with the peers, at sampled steps only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._torch_compat import foreach_sub_
from .grads import ParamIndex, per_param_norms
from .update_pieces import Pieces, copy_bytes, keeps_moments, local

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Optimizer state entries measured where present (the Adam family's first and second moment)."""
DEFAULT_COPY_BUDGET = 1 << 30
"""Bytes the sampled step's weight copy may take (``Config.update_copy_budget_mib``)."""

log = logging.getLogger("ddpmon")


class Reduction(Protocol):
    """What the probe needs of the strategies' reduction plan (``dtensor_norms``)."""

    mask: torch.Tensor | None
    """Per parameter: 1 where this rank's piece counts, 0 for a replica counted elsewhere
    (None: every piece counts, e.g. DeepSpeed's disjoint partitions)."""
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
        optimizer: Any,
        index: ParamIndex,
        every: int,
        step_of: Callable[[], int],
        on_error: Callable[[str, BaseException], None],
        reduction: Reduction | None = None,
        copy_budget: int = DEFAULT_COPY_BUDGET,
        pieces: Pieces | None = None,
    ) -> None:
        """``reduction``: the sum over the ranks holding disjoint pieces (None: the parameters
        are full and replicated, nothing is communicated). ``copy_budget``: the bytes the weight
        copy may take; a larger copy is never made (the samples are skipped, counted in
        ``skipped``, logged once), so the probe cannot push training out of memory.
        ``pieces``: where the stepped weights and moments live (default: the parameters and
        ``optimizer.state``, hooked by the torch optimizer's step hooks; any other is called by
        its owner through ``before_step``/``after_step``, e.g. ``probes.zero_updates``)."""
        if every < 1:
            raise ValueError(f"update sampling interval {every}: expected >= 1")
        self.optimizer = optimizer
        self.index = index
        self.every = every
        self._step_of = step_of
        self._on_error = on_error
        self.plan = reduction
        self.pieces = pieces if pieces is not None else Pieces(optimizer, index.params)
        self.moments = self.pieces.moments
        self.copy_bytes = self.pieces.copy_bytes()
        self.copy_budget = copy_budget
        self.skipped = 0
        """Sampled steps not measured: the weight copy would exceed ``copy_budget``."""
        self.sample_next = False
        """Set on the host (a spike was seen): sample the next step too. Honoured only where
        no collective is needed (one process, DDP), since ranks do not agree on when they
        read their records."""
        self._before: list[torch.Tensor] | None = None
        self._result: torch.Tensor | None = None
        self._index_cache: dict[tuple, torch.Tensor] = {}
        self._handles: list[Any] = [] if pieces is not None else [
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
        self.before_step()

    def _post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self.after_step()

    def before_step(self) -> None:
        """Before the optimizer steps: at a sampled step, copy the sources (this rank's pieces
        of the stepped weights), the one copy the update's norm needs."""
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
                self._before = [t.clone() for t in self.pieces.sources()]
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

    def after_step(self) -> None:
        """After the optimizer stepped: measure the sampled step (no-op at other steps)."""
        before, self._before = self._before, None
        if self.closed or before is None:
            return
        try:
            with torch.no_grad():
                self._result = self._measure(before)
        except Exception as exc:
            self._result = None
            self._on_error("updates", exc)

    def _measure(self, before: list[torch.Tensor]) -> torch.Tensor:
        """One fused norm pass over every piece's weights, update and moments; the squares
        placed at ``block * n + position`` of one float64 vector, summed over the plan."""
        pieces, n = self.pieces, len(self.index)
        sources = pieces.sources()
        foreach_sub_(before, sources)  # our copies become w_before - w_after in place
        tensors, targets = [], []
        for block, values in enumerate((sources, before)):
            tensors.extend(piece.view(values[piece.source]) for piece in pieces.layout)
            targets.extend(block * n + piece.position for piece in pieces.layout)
        blocks = 2
        if self.moments:
            state, keys = pieces.state()
            for name in MOMENTS:
                values = [_moment(state, key, name) for key in keys]
                for piece in pieces.layout:
                    value = values[piece.source]
                    if value is not None:
                        tensors.append(piece.view(value))
                        targets.append(blocks * n + piece.position)
                blocks += 1
        device = sources[0].device if sources else self.index.params[0].device
        if self.plan is not None:
            device = self.plan.device
        norms = per_param_norms(tensors).to(device=device, dtype=torch.float64) if tensors else None
        if len(targets) == blocks * n and targets == list(range(blocks * n)):
            vector = norms
        else:
            vector = torch.zeros(blocks * n, dtype=torch.float64, device=device)
            if norms is not None:
                vector.index_copy_(0, self._positions(targets, device), norms)
        vector = vector * vector
        if self.plan is None:
            return vector
        mask = self.plan.mask
        if mask is not None:
            vector = vector * mask.repeat(blocks)
        work = self.plan.start(vector)
        if work is not None:
            work.wait()  # a stream wait under NCCL; gloo: the peers' share, sampled steps only
        return vector

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

    def drop(self) -> None:
        """The step raised: nothing of it is measured."""
        self._before = None

    def add_handle(self, handle: Any) -> None:
        """Something with ``remove()`` that ``close`` undoes (a wrapped step)."""
        self._handles.append(handle)

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


def _moment(state: Any, key: Any, name: str) -> torch.Tensor | None:
    """The optimizer's ``name`` entry for ``key`` (its local piece), None where absent."""
    entry = state.get(key)
    value = entry.get(name) if isinstance(entry, dict) else None
    if isinstance(value, torch.Tensor) and value.numel() > 0:
        return local(value).detach()
    return None


__all__ = ["DEFAULT_COPY_BUDGET", "MOMENTS", "UpdateProbe", "copy_bytes", "keeps_moments"]
