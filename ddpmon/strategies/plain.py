"""A model without a wrapper that reduces gradients (one process, or a loop that all-reduces
``param.grad`` itself).

One process: local and global gradients are the same, measured at the end of every backward
pass, where they are complete and not yet clipped or unscaled by the loop (``clip_grad_norm_``
and ``scaler.unscale_`` run between backward and ``optimizer.step()``, so an optimizer pre-hook
would see clipped values). With gradient accumulation that is one pass per micro-step; the last
one before the step is kept.

Several processes without DDP/FSDP: the end of backward shows this rank's *local* gradients; the
global ones exist only after the loop's own all-reduce, so they are measured at the optimizer
step (after any clipping, unless the loop clips with ``ddpmon.clip_grad_norm_``, whose pre-clip
measurement is reused).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..probes.grads import full_pass, per_param_norms
from .base import GradientSource, GradSummaries, NormVector


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class PlainSource(GradientSource):
    name = "plain"

    def data_check_scope(self) -> tuple[str | None, str]:
        return None, "no data-parallel wrapper (DDP, FSDP2) whose local gradients it could read"

    def __init__(self, env) -> None:
        super().__init__(env)
        self._captured: NormVector | None = None
        self._clip_measured: NormVector | None = None
        self._backward_seen = False
        self.multi_process = _world_size() > 1

    def on_backward_end(self) -> None:
        self._backward_seen = True
        self._captured = None
        self._captured = full_pass(self.index, scaled=self.env.grads_scaled_now())

    def collect(self) -> GradSummaries:
        captured, self._captured = self._captured, None
        clipped, self._clip_measured = self._clip_measured, None
        seen, self._backward_seen = self._backward_seen, False
        if not self.multi_process:
            if not seen:  # no backward seen through the outputs (autograd.grad, ...)
                captured = full_pass(self.index, scaled=self.env.grads_scaled_now())
            return GradSummaries(reduced=captured, local_is_reduced=True)
        reduced = clipped or full_pass(self.index, scaled=self.env.grads_scaled_now())
        return GradSummaries(reduced=reduced, local=captured)

    def inflight(self) -> GradSummaries | None:
        """Exit path: the gradients as the last backward left them (one process: they are
        the reduced ones too)."""
        if self._captured is None:
            return None
        if not self.multi_process:
            return GradSummaries(reduced=self._captured, local_is_reduced=True)
        return GradSummaries(local=self._captured, local_complete=True)

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        positions = self.index.positions_of(params)
        if positions is None or not self.multi_process:
            return super().clip_norm(params)
        grads = [p.grad.detach() for p in params if p.grad is not None]

        norms = per_param_norms(grads)
        kept = [i for i, p in zip(positions, params, strict=True) if p.grad is not None]
        self._clip_measured = NormVector(norms, kept, scaled=self.env.grads_scaled_now())
        wide = norms.to(torch.float64)
        return (wide * wide).sum().sqrt()
