"""What the sharded sources (FSDP2/HSDP, TP) share beyond the norms: clipping by the step's
reduction (``ClipNormHelper``) and taking the reduced norms at collect, left in flight for the
record thread on CPU (``ShardedSource``). The norms themselves: ``dtensor_norms``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import GradientSource, GradSummaries, SourceEnv
from .dtensor_norms import ReductionPlan, ShardedNorms, build_plan, global_squares


class ClipNormHelper:
    """``clip_norm`` for sharded strategies: the step's reduction reused when it covers these
    exact, unchanged gradients (0 passes); else one pass plus the small reduction, with plans
    cached per distinct parameter list."""

    def __init__(
        self,
        norms: ShardedNorms | None = None,
        scale_state: Callable[[], tuple[bool, torch.Tensor | None]] | None = None,
        max_plans: int = 8,
    ) -> None:
        self.norms = norms
        self.scale_state = scale_state
        """() -> (gradients carry the loss scale now, the scale tensor)."""
        self._plans: dict[tuple[int, ...], ReductionPlan] = {}
        self._max = max_plans
        self.reused = 0
        """How many clip norms came from the step's reduction (tests, diagnostics)."""

    def norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        params = list(params)
        with torch.no_grad():
            if self.norms is not None:
                scaled_now, scale = self.scale_state() if self.scale_state else (False, None)
                reused = self.norms.reuse_for_clip(params, scaled_now, scale)
                if reused is not None:
                    self.reused += 1
                    return reused
            key = tuple(id(p) for p in params)
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= self._max:
                    self._plans.clear()
                plan = self._plans[key] = build_plan(params)
            return global_squares(params, plan).sum().sqrt()


class ShardedSource(GradientSource):
    """What the sharded sources (FSDP2/HSDP, TP) share: clipping by the step's reduction."""

    def __init__(self, env: SourceEnv) -> None:
        super().__init__(env)
        self._clip = ClipNormHelper(scale_state=self._scale_state)

    @property
    def norms(self) -> ShardedNorms | None:
        """The step's norms and their sum in flight (set at ``install``)."""
        return self._clip.norms

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._clip.norm(params)

    def _take_reduced(self, norms: ShardedNorms, out: GradSummaries) -> None:
        """The step's reduced norms into ``out``; left in flight for the record thread when
        nothing on the training thread reads them (``SourceEnv.defer_reduction_wait``)."""
        if not self.env.defer_reduction_wait:
            out.reduced = norms.take()
            return
        taken = norms.take_later(self.env.on_error)
        if taken is not None:
            out.reduced, out.deferred = taken

    def _scale_state(self) -> tuple[bool, torch.Tensor | None]:
        return self.env.grads_scaled_now(), self.env.current_scale()

    @property
    def clip_norms_reused(self) -> int:
        """``clip_norm`` calls answered from the step's reduction without a pass."""
        return self._clip.reused
