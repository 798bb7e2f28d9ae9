"""Gradient sources: where one optimizer step's gradients are seen, per parallelism strategy.

The gradient source is a strategy chosen at attach; the rest of the agent (step
pipeline, step vector, sinks) does not care which. A source produces *device* vectors of
per-parameter L2 norms (``NormVector``: one fused pass, e.g. ``probes.grads.per_param_norms``,
plus at most one small reduction) and never reads a device value on the host on the normal
path. Everything derived from them (global norm, group norms, the first non-finite parameter and
its kind, unscaling) is computed on the host after the lazy readback, off the hot path.

Contract every source keeps:
- ``reduced``: per-parameter norms of the *full* gradients of the step, before any clipping;
  their L2 combination is what ``torch.nn.utils.clip_grad_norm_`` returns (``.full_tensor()``
  for DTensor). Identical on every rank.
- ``local``: this rank's gradients *before* the reduction (pre all-reduce / reduce-scatter); its
  non-finite flag and first position name the origin parameter (``ParamIndex`` positions, i.e.
  the original FQNs).
- never all-gather a gradient; at most one small reduction of partial sums per step.
- any failure goes to ``env.on_error(probe, exc)``, never into the training loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..probes.comm import CollectiveRecorder, CommTiming
from ..probes.grads import NormVector, ParamIndex, per_param_norms

__all__ = [
    "CommTiming",
    "DeferredReduction",
    "GradSummaries",
    "GradientSource",
    "NormVector",
    "SourceEnv",
]


@dataclass(slots=True)
class GradSummaries:
    """Device results for one optimizer step; nothing here has been read on the host."""

    reduced: NormVector | None = None
    """Norms of the global (post-reduction), pre-clip gradients, identical on every rank."""
    local: NormVector | None = None
    """Norms of this rank's pre-reduction gradients (None: not measured this step)."""
    local_complete: bool = True
    """False when ``local`` covers only part of the parameters (its norm is then not reported,
    its non-finite flag still is)."""
    local_is_reduced: bool = False
    """True for a single-process model: local and reduced are the same gradients."""
    comm: CommTiming | None = None
    """Collectives timed this step (the pipeline fills it from ``GradientSource.collectives``)."""
    identical_ranks: torch.Tensor | None = None
    """Device count of other ranks whose sampled local-gradient fingerprint equals ours."""
    pp: Any = None
    """Pipeline parallel: the step's ``pipeline_parallel.PPStep`` (pp-reduced norm, origin
    probes); its source finishes the record (global norm, per-stage origin)."""
    deferred: DeferredReduction | None = None
    """The ``reduced`` norms are still being reduced (CPU): the readback finishes them."""


class DeferredReduction:
    """A norm reduction still in flight on the host, finished off the training thread: ``done``
    polls the collective, ``finish`` waits for it and runs the fills (the step's norms from the
    reduced vector; ``also`` adds one). ``finish`` never raises: a failed collective is reported
    and marks the step's reduced norms ``failed``."""

    __slots__ = ("_work", "_fills", "_on_error", "failed")

    def __init__(
        self, work: Any, fill: Callable[[], Any], on_error: Callable[[str, BaseException], None]
    ) -> None:
        self._work = work
        self._fills: list[Callable[[], Any]] | None = [fill]
        self._on_error = on_error
        self.failed = False

    def also(self, fill: Callable[[], Any]) -> None:
        """Run ``fill`` too once the collective is done (before ``finish``)."""
        if self._fills is None:  # finished already
            if not self.failed:
                fill()
        else:
            self._fills.append(fill)

    def done(self) -> bool:
        work = self._work
        if work is None:
            return True
        try:
            return bool(work.is_completed())
        except Exception:  # a work object that cannot say: finish() will wait for it
            return True

    def finish(self) -> None:
        work, fills, self._work, self._fills = self._work, self._fills, None, None
        if fills is None:
            return
        try:
            if work is not None:
                work.wait()
            for fill in fills:
                fill()
        except Exception as exc:
            self.failed = True
            self._on_error("grads", exc)


@dataclass(slots=True)
class SourceEnv:
    """What a source is given at attach."""

    model: torch.nn.Module
    index: ParamIndex
    on_error: Callable[[str, BaseException], None]
    local_norm_every: int = 10
    data_check_interval: int = 10
    comm_hook: Callable | None = None
    comm_state: Any = None
    amp: Any = None
    """The GradScaler probe (``probes.amp.ScalerProbe``) when a scaler is in use."""
    defer_reduction_wait: bool = False
    """Nothing on the training thread reads the reduced norms (``on_nonfinite='record'``), so a
    source may leave a host-side norm reduction in flight for the record thread to finish."""
    span: Any = None
    """``dtensor_norms.DisjointSpan``: pipeline parallel hands it to its sharded inner source,
    whose reduction then also sums over the pp group (one all-reduce, not two)."""

    def grads_scaled_now(self) -> bool:
        """Do the ``.grad`` tensors carry the loss scale right now (no ``unscale_`` yet)?"""
        amp = self.amp
        return amp is not None and amp.enabled() and not amp.grads_unscaled()

    def current_scale(self) -> torch.Tensor | None:
        amp = self.amp
        return amp.current_scale() if amp is not None and amp.enabled() else None


class GradientSource(ABC):
    """One strategy. Lifecycle: ``install()`` once, then per optimizer step any number of
    ``on_backward_end()`` calls (one per backward pass: gradient-accumulation micro-steps
    included) followed by exactly one ``collect()``; ``close()`` at the end."""

    name: ClassVar[str] = "base"
    decides_steps: ClassVar[bool] = False
    """True when the wrapped engine decides optimizer steps itself (DeepSpeed): the agent then
    takes steps from the engine, not from optimizer hooks or dropped gradients."""

    def __init__(self, env: SourceEnv) -> None:
        self.env = env
        self.index = env.index
        self._handles: list[Any] = []
        self.collectives = CollectiveRecorder(env.on_error)
        """Where this strategy records the collectives it sees (``ddpmon.probes.comm``)."""

    def data_check_scope(self) -> tuple[str | None, str]:
        """``(over, why_not)``: which ranks the duplicate-data check compares
        (:mod:`.data_check`), or None and why it does not run (the manifest's ``data_check``)."""
        return None, f"not available under {self.name}"

    def install(self) -> None:  # noqa: B027 (optional hook)
        """Register the hooks this strategy needs (default: none)."""

    def on_backward_end(self) -> None:  # noqa: B027 (optional hook)
        """A backward pass has finished (every gradient of it is accumulated). Default: no-op."""

    @abstractmethod
    def collect(self) -> GradSummaries:
        """Norms of the step that is ending now (device tensors; never read here)."""

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the current gradients of ``params`` as a device tensor, correct for
        this strategy (what ``clip_grad_norm_`` must clip by). Default: the gradients are full
        and replicated, so the local norm is the global one."""
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        norms = per_param_norms(grads)
        return (norms * norms).sum().sqrt()

    def close(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
