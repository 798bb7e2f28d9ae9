"""``on_nonfinite='rerun'`` under DeepSpeed: the engine takes no closure, so the loop hands the
step's forward and backward to ``mon.run_step(closure)`` before ``engine.step()``.

At the boundary ``engine.step`` (``EngineSteps.before_step``), once the reduced norms are
measured, the decision reads them with this rank's local ones (the one host read of
``StepRerun.read``). A step triggers when its reduced gradients are non-finite, identically on
every rank. Then every rank restores the RNG states and calls the closure once more: the engine's
own forward and ``engine.backward``, its own reductions.

DeepSpeed's reduced gradients live in its private partition buffers, which ddpmon neither clears
nor reads twice, so what the rerun tells comes from the gradients ddpmon's tensor hooks see
before DeepSpeed takes them: this rank's local gradients of the rerun, made alike on every rank
by one MIN all-reduce of a finite flag over the data-parallel group (on a triggered step only):

- a rank's rerun non-finite again: **deterministic**, ``NonFiniteGradientError`` on every rank
  before ``engine.step`` runs;
- every rank's rerun finite: **transient**. DeepSpeed then steps with whatever its buffers hold:
  ZeRO-1/2 at one micro-batch a step take the rerun's reduction in place of the first run's (the
  weights come out bit-identical to a run without the fault: ``tests/parallel/test_reruns.py``),
  so the step goes on with the rerun's gradients (action ``replace``); a buffer that kept the
  first run's non-finite values makes DeepSpeed's overflow check skip the step (action
  ``skip``). The event is written after ``engine.step``, from DeepSpeed's own skipped-step count.

Only the non-finite trigger applies here: a norm jump's rerun would have to replace the first
run's gradients, which DeepSpeed does not promise. Gradient accumulation over several
micro-batches is not replayable by one closure, and ZeRO-3 is not rerun; such steps are left to
DeepSpeed's own overflow skip, and ddpmon says so once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import GradSummaries


class EngineRerun:
    def __init__(self, flow: Any, source: Any, engine: Any) -> None:
        self.flow = flow
        self.source = source
        self.engine = engine
        self._pending: Any = None  # the agent's rerun Outcome

    def before_step(self) -> None:
        rerun = self.flow.rerun
        if rerun.norm_jump > 0:
            rerun.say_once("ddpmon: rerun_norm_jump is not applied under DeepSpeed (its buffers "
                           "keep both runs' gradients); non-finite steps are rerun")
        first_local = self.source.local_now()
        first_s = GradSummaries(reduced=self.source.reduced_now(), local=first_local)
        first = rerun.read(first_s)
        if first is None or first.reduced_finite:
            rerun.applied(first)
            return
        held = rerun.held
        if held is None:
            rerun.no_closure()
            return
        if (not held.replayable or _accumulation_steps(self.engine) > 1
                or self.source.facts.stage == 3):
            rerun.not_replayable()
            return  # DeepSpeed's own overflow check skips the non-finite step
        squares = self.source.swap_local()
        rerun.rerunning = True
        try:
            held.rng.restore()
            held.replay()
        finally:
            rerun.rerunning = False
        second = self._rerun_reading()
        self.source.swap_local(squares)  # the step's record keeps the first run's local norms
        outcome = rerun.classify("nonfinite", first, second, first_s, first_s)
        if outcome.raises:
            step = self.flow.step
            rerun.report(step, outcome)
            rerun.counted(outcome.fault)
            raise rerun.error_for(step, outcome)
        self._pending = outcome  # written once DeepSpeed has stepped or skipped

    def after_step(self, skipped: bool) -> None:
        """After ``engine.step``: the transient step's event, with what DeepSpeed did."""
        outcome, self._pending = self._pending, None
        if outcome is None:
            return
        outcome.skip = skipped
        outcome.action = "skip" if skipped else "replace"
        rerun = self.flow.rerun
        rerun.report(self.flow.step, outcome)
        rerun.counted(outcome.fault)

    def _rerun_reading(self) -> Any:
        """Whether this rank's rerun and every rank's rerun were finite (one MIN all-reduce,
        one host read)."""
        local = self.source.local_now()
        device = local.norms.device if local is not None else torch.device("cpu")
        mine = (torch.isfinite(local.norms).all() if local is not None
                else torch.ones((), dtype=torch.bool, device=device)).to(torch.float64)
        flags = torch.stack([mine, mine.clone()])
        group = getattr(self.engine.optimizer, "dp_process_group", None)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flags[1:], op=torch.distributed.ReduceOp.MIN,
                                         group=group)
        local_finite, all_finite = flags.tolist()  # a triggered step only
        return self.flow.rerun.reading(bool(all_finite), bool(local_finite))


def _accumulation_steps(engine: Any) -> int:
    try:
        return int(engine.gradient_accumulation_steps())
    except Exception:
        return 1
