"""The Transformers Trainer's steps as ddpmon can rerun them (``on_nonfinite="rerun"``).

The Trainer runs a step as ``training_step(model, inputs, num_items_in_batch)`` once per
micro-batch, clips, then calls ``optimizer.step()`` without a closure. ``StepRecorder`` wraps
``trainer.training_step`` (an instance attribute, removed at close) to keep the step's calls and
the RNG states before its first one; ddpmon's optimizer pre-hook replays them when the step
triggers (``agent.rerun.decide_recorded``). The replay runs each micro-batch as the Trainer did:
inside Accelerate's ``no_sync`` except the last (unless the accelerator syncs every batch), then
clips to ``max_grad_norm`` as the Trainer does before stepping.

The batch is held by reference for its step only (the list is emptied at every step's begin
and end) and never written; the RNG copy is host memory (on a GPU, the generator's seed and
offset): no device sync.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ..agent.rerun import Recorded, RngState, StepRerun

log = logging.getLogger("ddpmon")


class StepRecorder:
    def __init__(self, trainer: Any, rerun: StepRerun) -> None:
        self.trainer = trainer
        self.rerun = rerun
        self._original = trainer.training_step
        self._calls: list[tuple[tuple, dict]] = []
        self._rng: RngState | None = None
        trainer.training_step = self._training_step  # shadows the method on this instance
        rerun.recorded = self.recorded

    def new_step(self) -> None:
        self._calls.clear()
        self._rng = None

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.rerun.rerunning:
            try:
                if not self._calls:
                    self._rng = RngState(self.rerun.device)
                self._calls.append((args, kwargs))
            except Exception as exc:  # recording never stops training
                log.debug("ddpmon: training_step not recorded: %s", exc)
                self._rng = None
        return self._original(*args, **kwargs)

    def recorded(self) -> Recorded | None:
        if not self._calls or self._rng is None:
            return None
        return Recorded(self._replay, self._rng)

    def _replay(self) -> Any:
        trainer, calls = self.trainer, list(self._calls)
        accelerator = getattr(trainer, "accelerator", None)
        plugin = getattr(getattr(accelerator, "gradient_state", None), "plugin_kwargs", {}) or {}
        sync_each = bool(plugin.get("sync_each_batch", False))
        loss = None
        for i, (args, kwargs) in enumerate(calls):
            model = args[0] if args else kwargs.get("model")
            deferred = i < len(calls) - 1 and not sync_each and accelerator is not None
            context = accelerator.no_sync(model=model) if deferred else contextlib.nullcontext()
            with context:
                loss = self._original(*args, **kwargs)
        max_norm = float(getattr(trainer.args, "max_grad_norm", 0) or 0)
        if max_norm > 0 and accelerator is not None:
            accelerator.clip_grad_norm_(trainer.model.parameters(), max_norm)
        return loss

    def close(self) -> None:
        if self.trainer.__dict__.get("training_step") == self._training_step:
            del self.trainer.training_step
        if self.rerun.recorded == self.recorded:
            self.rerun.recorded = None
        self.new_step()
