"""Attach-time wiring of the loss-spike parts (docs/loss-spikes.md): the update probe on the
optimizer, the max-logit probe on the named modules, and the spike detector among the record
sinks. Kept apart from ``monitor.py`` so the monitor only calls ``install`` and ``close``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..metrics import step_slots as slot
from ..probes.logits import LogitProbe
from ..probes.updates import UpdateProbe
from ..strategies.base import UpdateSettings
from ..strategies.dtensor_norms import build_plan, is_dtensor, reduce_async
from .spikes import SpikeDetector, SpikeSettings
from .update_records import group_stats

log = logging.getLogger("ddpmon")


@dataclass(slots=True)
class SpikeParts:
    updates: Any = None
    logits: Any = None
    detector: SpikeDetector | None = None

    @classmethod
    def install(cls, monitor: Any, pp: Any, state: Any, emit: Any) -> SpikeParts:
        """Build the parts for ``monitor`` (its flow exists, its step markers not yet: the
        update probe's optimizer hooks must run before the flow's, which close the step).
        A part that cannot be built is counted under its probe; training goes on."""
        config: Config = monitor.config
        guard, flow = monitor.guard, monitor.flow
        parts = cls()
        if config.update_every > 0:
            with guard("updates"):
                parts.updates = update_probe(monitor, lambda: flow.step)
                if parts.updates is not None and config.update_series:
                    state.update_ratios = {}
        if config.logit_modules:
            with guard("logits"):
                parts.logits = LogitProbe(monitor.model, config.logit_modules, guard.error)
        settings = SpikeSettings(
            window=config.spike_window, threshold=config.spike_threshold,
            min_ratio=config.spike_min_ratio, recover_steps=config.spike_recover_steps,
            warmup=min(16, config.spike_window),
        )
        parts.detector = SpikeDetector(settings, emit, state.set_spike_unrecovered,
                                       on_spike=parts._sample_next, on_close=parts.close)
        flow.sinks.append(parts.detector)
        if parts.updates is not None or parts.logits is not None:
            flow.probes = parts
        return parts

    def take(self, guard: Any) -> dict[str, Any]:
        """The step's device values by slot (training thread, at the step's end); a part that
        fails is counted under its probe and absent for this step, the others kept."""
        return {
            slot.UPDATE_SQUARES: guard.taken("updates", self.updates),
            slot.LOGIT_MAX: guard.taken("logits", self.logits),
        }

    def finish(self, record: Any, parts: dict[str, list[float]], index: Any, guard: Any) -> None:
        """Fill ``record`` from the read-back slots (record thread)."""
        if slot.UPDATE_SQUARES in parts:
            with guard("updates"):
                record.update_stats = group_stats(parts[slot.UPDATE_SQUARES], index)
        if slot.LOGIT_MAX in parts and self.logits is not None:
            with guard("logits"):
                record.logit_max = dict(zip(self.logits.names, parts[slot.LOGIT_MAX],
                                            strict=True))

    def _sample_next(self) -> None:
        if self.updates is not None:
            self.updates.sample_next = True

    def note_samples(self, step: int, ids: Any) -> None:
        if self.detector is not None:
            self.detector.note_samples(step, ids)

    def close(self) -> None:
        for part in (self.updates, self.logits):
            if part is not None:
                part.close()


@dataclass(slots=True)
class _PlanReduction:
    """The strategies' reduction plan (``dtensor_norms``) in the shape the probe asks for."""

    plan: Any

    @property
    def mask(self) -> Any:
        return self.plan.mask

    @property
    def device(self) -> Any:
        return self.plan.device

    def start(self, vector: Any) -> Any:
        return reduce_async(vector, self.plan)


def update_probe(monitor: Any, step_of: Any) -> UpdateProbe | None:
    """The update probe for ``monitor``'s strategy: by default on the torch optimizer's step
    hooks; a strategy whose engine steps something else builds its own
    (``GradientSource.update_probe``)."""
    config, guard, index = monitor.config, monitor.guard, monitor.index
    settings = UpdateSettings(index, config.update_every, step_of, guard.error,
                              config.update_copy_budget_mib << 20)

    def default(optimizer: Any) -> UpdateProbe | None:
        if optimizer is None or not index.params:
            return None
        return UpdateProbe(optimizer, index, settings.every, step_of, guard.error,
                           sharded_reduction(index.params), copy_budget=settings.copy_budget)

    return monitor.source.update_probe(monitor.optimizer, settings, default)


def sharded_reduction(params: list[Any]) -> _PlanReduction | None:
    """The sum of the update probe's squares for DTensor parameters (the same plan as the
    gradient norms: shard dims summed, replicas counted once), or None: nothing to reduce."""
    if not any(is_dtensor(p) for p in params):
        return None
    plan = build_plan(params)
    return _PlanReduction(plan) if plan.groups else None
