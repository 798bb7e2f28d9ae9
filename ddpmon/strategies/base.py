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

from ..metrics.step_slots import Slot
from ..probes.comm import CollectiveRecorder, CommTiming
from ..probes.grads import NormVector, ParamIndex, per_param_norms
from .reduction import DeferredReduction
from .replicas import ReplicaScope

__all__ = [
    "BatchShare",
    "CommTiming",
    "DeferredReduction",
    "EngineFloor",
    "GradSummaries",
    "GradientSource",
    "NormVector",
    "SourceEnv",
    "StepExtension",
    "StepHost",
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
    extension: StepExtension | None = None
    """What the strategy adds to this step beyond the common slots (pipeline parallel: the norm
    summed over stages, the stage probes' flags); the step pipeline knows nothing else of it."""
    deferred: DeferredReduction | None = None
    """The ``reduced`` norms are still being reduced (CPU): the readback finishes them."""


class StepExtension(ABC):
    """One step's strategy-specific part, carried from ``collect`` to the record thread.

    The step pipeline queues ``values()`` under the source's declared ``extra_slots``, hands
    ``decision_norm()`` to the skip/raise policy, and the record thread lets ``global_norm`` and
    ``finish`` complete the record from the read-back values. ``build_record`` stays the one
    writer of ``record.grad_norm``: it takes ``global_norm``'s value where the extension
    ``replaces_global_norm`` (a pipeline stage's reduced norms cover only its own stages)."""

    replaces_global_norm: ClassVar[bool] = False
    elsewhere: ClassVar[str] = "another rank"
    """Where a non-finite value was when ``decision_norm`` is non-finite but this rank's
    reduced norms are finite (the ``param`` of its ``nonfinite`` event)."""

    @abstractmethod
    def values(self) -> dict[str, torch.Tensor | None]:
        """Device tensors by extra slot name (None: absent this step)."""

    def decision_norm(self) -> torch.Tensor | None:
        """A device tensor whose non-finite values mean the step's global gradient is not
        finite, identical on every rank that decides (None: the reduced norms decide)."""
        return None

    def global_norm(self, parts: dict[str, list[float]]) -> float | None:
        """The step's global norm from the read-back ``parts`` (``replaces_global_norm``)."""
        return None

    def finish(  # noqa: B027 (optional hook)
        self, record: Any, parts: dict[str, list[float]], local: tuple | None,
        reduced: tuple | None,
    ) -> None:
        """Complete ``record`` (record thread). ``local``/``reduced``: (host values, positions)
        of this step's norm vectors, or None."""


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


@dataclass(frozen=True, slots=True)
class EngineFloor:
    """An engine's own loss scaler gave up at its minimum scale inside its step (its exception,
    ``cause``). The strategy says whose floor it was: the event's ``source`` and the error's
    first sentence (``head(step)``); the agent's floor policy records or re-raises it."""

    source: str
    scale: float | None
    cause: BaseException
    head: Callable[[int], str]


@dataclass(slots=True)
class StepHost:
    """What the agent hands a strategy's ``markers``: its own objects, passed in, so that a
    strategy marks its steps without the agent knowing which strategy it is."""

    model: torch.nn.Module
    optimizer: Any
    steps: Any
    """The agent's step pipeline: ``forward_started(args)``, ``backward_ended()``, ``step``,
    ``rerun`` (None unless ``on_nonfinite='rerun'``)."""
    on_error: Callable[[str, BaseException], None]
    on_engine_step: Callable[[Any], None]
    """An engine that decides its own steps ended one (facts: ``skipped``, ``scale_after``,
    ``engine_step``)."""
    on_engine_floor: Callable[[EngineFloor], None]


@dataclass(frozen=True, slots=True)
class UpdateSettings:
    """What an update probe is built with (``GradientSource.update_probe``)."""

    index: Any
    every: int
    step_of: Callable[[], int]
    on_error: Callable[[str, BaseException], None]
    copy_budget: int


@dataclass(frozen=True, slots=True)
class BatchShare:
    """Who trains on this rank's batch (``GradientSource.batch_share``): the ``ranks`` of one
    model replica (TP peers, pipeline stages) all train on the same batch, so each exports
    ``1/ranks`` of its tokens and the run's sum counts the batch once."""

    ranks: int = 1
    """Ranks that train on the same batch: the model-parallel degree (1 under data parallel)."""
    reads_at: torch.nn.Module | None = None
    """The module whose forward inputs carry the batch on this rank (None: the attached model)."""
    activations: bool = False
    """``reads_at`` is given an earlier stage's activations, not the batch: its tokens are the
    activation's every dim but the features (``flops.auto.activation_count``)."""
    over: str = "this rank alone"
    """Who shares the batch, in words."""


class GradientSource(ABC):
    """One strategy. Lifecycle: ``install()`` once, then per optimizer step any number of
    ``on_backward_end()`` calls (one per backward pass: gradient-accumulation micro-steps
    included) followed by exactly one ``collect()``; ``close()`` at the end."""

    name: ClassVar[str] = "base"
    extra_slots: ClassVar[tuple[Slot, ...]] = ()
    """Step-vector slots of this strategy's own (``StepExtension.values``)."""
    decides_steps: ClassVar[bool] = False
    """True when the wrapped engine decides optimizer steps itself (DeepSpeed): the agent then
    takes steps from the engine (``markers`` reports them through ``StepHost.on_engine_step``),
    not from optimizer hooks or dropped gradients."""
    has_loss: bool = True
    """False on a rank that never sees the loss (a pipeline stage before the last)."""

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

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        """``(scope, why_not)``: the parameters this rank holds as a data-parallel replica and
        the group of those replicas (:mod:`.replicas`), or None and why there are none (the
        manifest's ``replica_check``)."""
        return None, f"no data-parallel replicas under {self.name}"

    def install(self) -> None:  # noqa: B027 (optional hook)
        """Register the hooks this strategy needs (default: none)."""

    def markers(self, host: StepHost) -> list[Any]:
        """What marks this strategy's steps beyond torch's module and optimizer hooks (a
        schedule's ``step()``, an engine's ``step()``), installed now; each has ``close()``.
        The agent removes them together. Default: none."""
        return []

    engine_facts: Any = None
    """Facts of an engine that decides its own precision and loss scale (``precision``:
    ``fp32``/``bf16``/``fp16``), None when the loop's optimizer and scaler decide
    (:mod:`.precision` reads it)."""

    def manifest_extra(self) -> dict[str, Any]:
        """What this strategy adds to the run manifest (default: nothing)."""
        return {}

    def stage_label(self) -> str | None:
        """The stages this rank runs (``"1"``, ``"0,2"`` interleaved), kept in its history's
        metadata so that straggler attribution compares a stage with its peers
        (``forensics.stragglers``); None for a strategy without stages."""
        return None

    def batch_share(self) -> BatchShare:
        """The ranks that train on this rank's batch and where the batch is read (the per-rank
        tokens/s, ``agent.throughput_live``); by default this rank alone, at the model."""
        return BatchShare()

    def update_probe(self, optimizer: Any, settings: UpdateSettings,
                     default: Callable[[Any], Any]) -> Any:
        """The per-group update probe (``probes.updates``) for the optimizer step this strategy
        takes, or None (figures off): by default ``default(optimizer)``, on the torch
        optimizer's step hooks. A strategy whose engine steps something else overrides it."""
        return default(optimizer)

    def on_backward_end(self) -> None:  # noqa: B027 (optional hook)
        """A backward pass has finished (every gradient of it is accumulated). Default: no-op."""

    @abstractmethod
    def collect(self) -> GradSummaries:
        """Norms of the step that is ending now (device tensors; never read here)."""

    def inflight(self) -> GradSummaries | None:
        """Exit path only (the step failed, so reading devices is allowed after): what the hooks
        have seen of the step in progress that ``collect`` never closed, as device vectors
        (partial local and reduced norms). None: nothing, or the strategy does not say."""
        return None

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
        order = getattr(self.index, "order", None)
        if order is not None:  # its one-shot hooks, if no step ended since attach
            order.close()
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
