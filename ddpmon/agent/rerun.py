"""``on_nonfinite='rerun'``: run a bad step once more to tell a transient fault from a
deterministic one, before the optimizer applies anything.

The loop hands its step over as a closure, ``optimizer.step(closure)`` (torch's own contract,
which Lightning's automatic optimization follows). torch lets a step pre-hook replace the
closure; ddpmon's wraps it:

1. the RNG states are copied (the CPU generator, and the device's, which is a host-side seed
   and offset: no device sync);
2. the loop's closure runs: forward, backward, the reduction, as always;
3. one host read of three numbers: are the reduced gradients finite, are this rank's local
   (pre-reduction) gradients finite, the global norm. It is the read ``skip`` and ``raise``
   make too; nothing else happens on a step that does not trigger;
4. a step triggers when its reduced gradients are non-finite, or (``rerun_norm_jump`` > 0) when
   its global norm exceeds that factor times the median of the last 32 applied steps. Both read
   reduced values, identical on every rank, so every rank decides alike without a collective;
5. every rank drops its gradients, restores the RNG states and runs the closure once more: the
   same batch (the closure holds it) and the same random numbers (dropout), through the same
   collectives. The step flow ignores the rerun's forward as a step boundary;
6. the rerun classifies the step, again from reduced values:
   - **transient**: the fault did not reproduce (finite gradients; for a norm jump, a global
     norm that differs from the first by more than 1e-3). The rank whose local gradients were
     non-finite is the suspect: its device, by GPU UUID. The step is skipped (gradients
     dropped), so nothing computed on that device this step reaches the weights;
   - **deterministic**: the fault reproduced. The batch or the numerics cause it. A
     non-finite step raises ``NonFiniteGradientError`` on every rank at the same step, naming
     the batch's sample ids where the loop gave them (``mon.observe_samples``); a norm jump
     that reproduces is the data's own, and the step goes on with the rerun's gradients.

A ``rerun`` event on every rank (``origin`` on the rank whose local gradients were bad), an
evidence bundle on that rank with the batch's shapes, dtypes and sample ids (never the data),
and ``ddpmon_step_reruns_total{fault}``. A loop that steps without a closure cannot be rerun:
its non-finite steps are skipped, as under ``skip``, said once. The exception is a trainer whose
integration records each step's micro-steps as they run (the Transformers Trainer's
``training_step`` calls): ``decide_recorded`` replays them from the optimizer's pre-hook, the
same decision before anything is applied.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..forensics.verdict import format_ids
from ..probes.grads import ParamIndex, summarize_host
from ..strategies.base import GradSummaries
from .policy import NonFiniteGradientError

log = logging.getLogger("ddpmon")

JUMP_HISTORY = 32
"""Applied steps whose global norms the jump trigger compares against (their median)."""
JUMP_MIN_HISTORY = 8
"""No jump is judged before this many applied steps."""
JUMP_SAME = 1e-3
"""A rerun's global norm within this relative difference of the first reproduces the jump."""
MAX_SAMPLE_IDS = 64
"""Sample ids kept in an event or evidence bundle (the count is always kept)."""


@dataclass(slots=True)
class StepReading:
    """The one host read of a step: reduced finite, local finite, global norm."""

    reduced_finite: bool
    local_finite: bool
    norm: float


@dataclass(slots=True)
class Outcome:
    trigger: str
    """``nonfinite`` or ``norm_jump``."""
    fault: str
    """``transient`` or ``deterministic``."""
    origin: bool
    """This rank's local gradients were bad in the first run (non-finite, or a norm jump
    this rank's local norm carried)."""
    first: StepReading
    rerun: StepReading
    param: str | None
    """The first non-finite parameter of this rank's local gradients (first run, else rerun)."""
    skip: bool
    raises: bool
    action: str | None = None
    """What happened to the step where the engine decided it (an engine's own rerun:
    ``replace``, the rerun's gradients went on, or ``skip``); None: from ``skip`` and
    ``raises``."""


@dataclass(slots=True)
class Recorded:
    """A step a trainer ran before ``optimizer.step()``, as it can be run again."""

    replay: Callable[[], Any]
    """Runs every micro-step of the step once more (forward, backward), as the trainer did."""
    rng: RngState
    """The generators as they were before the step's first micro-step."""
    replayable: bool = True
    """False when gradients began accumulating before the replay's first micro-step."""


class RngState:
    """The generators a forward pass draws from: CPU, and the rank's accelerator."""

    __slots__ = ("_cpu", "_device", "_index")

    def __init__(self, device: str) -> None:
        self._cpu = torch.get_rng_state()
        self._device, self._index = None, None
        if device.startswith("cuda") and torch.cuda.is_initialized():
            self._index = torch.device(device).index or 0
            self._device = torch.cuda.get_rng_state(self._index)

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        if self._device is not None:
            torch.cuda.set_rng_state(self._device, self._index)


class StepRerun:
    def __init__(
        self,
        *,
        index: ParamIndex,
        rank: int,
        device: str,
        gpu_uuid: str,
        norm_jump: float,
        emit: Callable[..., None],
        evidence: Callable[..., None],
        count: Callable[[str], None],
        counted: Callable[[str], None],
    ) -> None:
        self.index = index
        self.rank = rank
        self.device = device
        self.gpu_uuid = gpu_uuid
        self.norm_jump = norm_jump
        self._emit = emit
        self._evidence = evidence
        self._count = count
        self.counted = counted
        """Counts a rerun by its fault (``ddpmon_step_reruns_total``)."""
        self._norms: deque[float] = deque(maxlen=JUMP_HISTORY)
        self.samples: Any = None
        """Sample ids of the step in progress (``mon.observe_samples``), read only on a rerun."""
        self.batch: list[dict[str, Any]] | None = None
        """Shapes and dtypes of the rerun's forward inputs (captured while it runs)."""
        self.rerunning = False
        self.held: Recorded | None = None
        """The step handed over through ``mon.run_step(closure)``, until the step ends."""
        self.recorded: Callable[[], Recorded | None] | None = None
        """Set by a trainer integration that records each step's micro-steps (the Transformers
        Trainer): the step as a replay, for loops that step without a closure."""
        self._told: set[str] = set()

    @classmethod
    def for_monitor(cls, mon: Any, state: Any, emit: Callable[..., None]) -> StepRerun:
        """The policy of a ``Monitor`` being built (its metric state and event writer); its
        counter is exported from 0."""
        ident = mon.ctx.identity
        state.step_reruns_total = {"deterministic": 0, "transient": 0}
        return cls(
            index=mon.index, rank=ident.rank, device=ident.device, gpu_uuid=ident.gpu_uuid,
            norm_jump=mon.config.rerun_norm_jump, emit=emit,
            evidence=lambda step, param, **info: mon.incidents.write_evidence(
                "rerun", step, param, **info),
            count=mon.guard.count, counted=state.count_rerun,
        )

    def not_replayable(self) -> None:
        """Gradients accumulated outside the closure: nothing to rerun; said once."""
        self.say_once(
            "ddpmon: on_nonfinite='rerun' cannot rerun a step whose gradients began "
            "accumulating before optimizer.step(closure) (micro-steps outside the closure): "
            "its non-finite steps are skipped without a rerun (as under on_nonfinite='skip').")

    def no_closure(self) -> None:
        """The loop stepped without a closure: nothing to rerun; said once."""
        self.say_once(
            "ddpmon: on_nonfinite='rerun' reruns a step handed over as "
            "optimizer.step(closure); this loop steps without one, so its non-finite steps "
            "are skipped without a rerun (as under on_nonfinite='skip').")

    def say_once(self, message: str) -> None:
        """Warn once per message (a limit of the rerun, not a per-step event)."""
        if message not in self._told:
            self._told.add(message)
            log.warning(message)

    # ------------------------------------------------------------------ per step
    @staticmethod
    def reading(reduced_finite: bool, local_finite: bool) -> StepReading:
        """A reading made by a strategy's own rerun (no global norm: NaN)."""
        return StepReading(reduced_finite, local_finite, math.nan)

    def read(self, s: GradSummaries) -> StepReading | None:
        """The one host read (None: nothing to decide on, e.g. no reduced norms)."""
        if s.reduced is None or s.deferred is not None:
            return None
        reduced = s.reduced.norms
        parts = [torch.isfinite(reduced).all().to(torch.float64),
                 torch.ones((), dtype=torch.float64, device=reduced.device),
                 reduced.double().square().sum().sqrt()]
        if s.local_is_reduced:
            parts[1] = parts[0]
        elif s.local is not None:
            parts[1] = torch.isfinite(s.local.norms).all().to(torch.float64).to(reduced.device)
        if s.extension is not None:
            decision = s.extension.decision_norm()
            if decision is not None:
                parts[0] = parts[0] * torch.isfinite(decision.to(reduced.device)).all()
        finite, local, norm = torch.stack(parts).tolist()  # the one documented host read
        return StepReading(bool(finite), bool(local), norm)

    def trigger(self, reading: StepReading) -> str | None:
        if not reading.reduced_finite:
            return "nonfinite"
        jumped = (self.norm_jump > 0 and len(self._norms) >= JUMP_MIN_HISTORY
                  and reading.norm > self.norm_jump * statistics.median(self._norms))
        return "norm_jump" if jumped else None

    def applied(self, reading: StepReading | None) -> None:
        """A step went on with these gradients: its norm joins the jump trigger's history."""
        if reading is not None and reading.reduced_finite and math.isfinite(reading.norm):
            self._norms.append(reading.norm)

    def saw_batch(self, args: tuple) -> None:
        """The rerun's forward inputs: shapes and dtypes only, never values."""
        if self.batch is None:
            self.batch = [
                {"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")}
                for a in args if isinstance(a, torch.Tensor)
            ]

    # ------------------------------------------------------------------ a triggered step
    def classify(
        self, trigger: str, first: StepReading, rerun: StepReading,
        first_summaries: GradSummaries, rerun_summaries: GradSummaries,
    ) -> Outcome:
        if trigger == "nonfinite":
            reproduced = not rerun.reduced_finite
            origin = not first.local_finite or (reproduced and not rerun.local_finite)
        else:
            reproduced = rerun.reduced_finite and _close(first.norm, rerun.norm)
            origin = True  # the norm is global: every rank names itself, the event says so
        param = None
        if trigger == "nonfinite" and origin:
            param = _first_bad(first_summaries, self.index) or _first_bad(
                rerun_summaries, self.index)
        fault = "deterministic" if reproduced else "transient"
        return Outcome(
            trigger=trigger, fault=fault, origin=origin, first=first, rerun=rerun,
            param=param, skip=not reproduced,
            raises=reproduced and trigger == "nonfinite",
        )

    def report(self, step: int, outcome: Outcome) -> None:
        """The event on every rank, the evidence on the origin rank. Never raises."""
        action = outcome.action or (
            "raise" if outcome.raises else "skip" if outcome.skip else "apply")
        ids, count = self.sample_ids()
        fields: dict[str, Any] = {
            "trigger": outcome.trigger,
            "fault": outcome.fault,
            "origin": outcome.origin,
            "action": action,
            "device": self.device,
            "gpu_uuid": self.gpu_uuid or None,
            "param": outcome.param,
            "grad_norm": _number(outcome.first.norm),
            "rerun_grad_norm": _number(outcome.rerun.norm),
            "batch": self.batch,
            "sample_ids": ids,
            "sample_count": count,
        }
        self._emit("rerun", step, **fields)
        if outcome.origin:
            info = {k: v for k, v in fields.items() if k != "param"}
            self._evidence(step, outcome.param, **info)

    def error_for(self, step: int, outcome: Outcome) -> NonFiniteGradientError:
        head = (f"ddpmon: non-finite gradient at step {step} reproduced on a rerun of the same "
                "batch and RNG state (deterministic: the data or the numerics, not the hardware)")
        if not outcome.origin:
            return NonFiniteGradientError(
                f"{head}; rank {self.rank}'s own gradients were finite: another rank is the "
                "origin (ddpmon timeline names it)")
        ids, count = self.sample_ids()
        batch = f"; batch sample ids {format_ids(ids, count)}" if ids else ""
        where = f" in parameter {outcome.param}" if outcome.param else ""
        return NonFiniteGradientError(f"{head}; rank {self.rank} is the origin{where}{batch}")

    def sample_ids(self) -> tuple[list[int] | None, int | None]:
        """The step's sample ids as plain ints (at most ``MAX_SAMPLE_IDS``) and their count."""
        value = self.samples
        if value is None:
            return None, None
        try:
            if isinstance(value, torch.Tensor):
                value = value.detach().reshape(-1).tolist()  # a triggered step only
            ids = [int(v) for v in value]
        except (TypeError, ValueError) as exc:
            self._count("step")
            log.warning("ddpmon: sample ids %r are not integers (%s)", type(value).__name__, exc)
            return None, None
        return ids[:MAX_SAMPLE_IDS], len(ids)

    def end_step(self) -> None:
        self.samples = None
        self.batch = None
        self.held = None

    def step_in_hand(self) -> Recorded | None:
        """The step as it can be run again: handed over (``run_step``) or recorded by a
        trainer integration; None when neither."""
        if self.held is not None:
            return self.held
        return self.recorded() if self.recorded is not None else None


def wrap_closure(
    flow: Any, closure: Callable[[], Any], replayable: bool = True
) -> Callable[[], Any]:
    """The closure torch's optimizer calls in place of the loop's (see the module doc).
    ``replayable``: False when this step's gradients began accumulating before the closure
    (micro-steps outside it): the closure alone cannot reproduce them, so a non-finite step is
    skipped without a rerun, as under ``skip``."""
    rerun: StepRerun = flow.rerun

    def step_closure() -> Any:
        rng = None
        with flow.guard("step"):
            rng = RngState(rerun.device)
        loss = closure()
        if rng is None:
            return loss
        outcome, again = None, None
        with flow.guard("step"):
            outcome, again = _decide(flow, rerun, closure, rng, replayable)
        if outcome is not None and outcome.raises:
            raise rerun.error_for(flow.step, outcome)  # deliberately, on every rank
        return loss if again is None else again

    return step_closure


def run_step(flow: Any, closure: Callable[[], Any]) -> Any:
    """``mon.run_step(closure)``: run the step's forward and backward now and keep them in
    hand, so that the ``optimizer.step()`` (or an engine's ``engine.step()``) that follows can
    rerun them. The closure's own exceptions are the loop's."""
    rerun: StepRerun = flow.rerun
    rng, replayable = None, not flow.backward_pending
    with flow.guard("step"):
        rng = RngState(rerun.device)
    loss = closure()
    if rng is not None:
        rerun.held = Recorded(closure, rng, replayable)
    return loss


def decide_recorded(flow: Any) -> bool:
    """A step without a closure that was handed over (``run_step``) or recorded (a trainer):
    decided here, in the optimizer's pre-hook, before anything is applied. False when the
    step is not in hand."""
    rerun: StepRerun = flow.rerun
    outcome, recorded = None, None
    with flow.guard("step"):
        recorded = rerun.step_in_hand()
        if recorded is not None:
            outcome, _ = _decide(flow, rerun, recorded.replay, recorded.rng,
                                 recorded.replayable)
    if outcome is not None and outcome.raises:
        raise rerun.error_for(flow.step, outcome)  # deliberately, on every rank
    return recorded is not None


def _decide(flow: Any, rerun: StepRerun, closure: Callable[[], Any], rng: RngState,
            replayable: bool = True):
    """Read the step; when it triggers, run it again and act. (outcome, the rerun's loss)."""
    first_s = flow.collect_now()
    first = rerun.read(first_s)
    trigger = rerun.trigger(first) if first is not None else None
    if trigger is None:
        rerun.applied(first)
        return None, None
    if not replayable:
        rerun.not_replayable()
        if trigger == "nonfinite":
            flow.drop_grads()
            flow.skipped_by_policy()
        return None, None
    flow.drop_grads()
    flow.recollect()
    rerun.rerunning = True
    loss = None
    try:
        rng.restore()
        loss = closure()
    except Exception as exc:  # the loop's own code failed the second time: count, skip
        flow.guard.error("step", exc)
        flow.drop_grads()
        flow.skipped_by_policy()
        return None, None
    finally:
        rerun.rerunning = False
    second_s = flow.collect_now()
    second = rerun.read(second_s) or StepReading(False, False, math.nan)
    outcome = rerun.classify(trigger, first, second, first_s, second_s)
    step = flow.step
    rerun.report(step, outcome)
    rerun.counted(outcome.fault)
    if outcome.skip:
        flow.drop_grads()
        flow.skipped_by_policy()
    elif not outcome.raises:
        rerun.applied(second)
    return outcome, loss


def _first_bad(s: GradSummaries, index: ParamIndex) -> str | None:
    vector = s.local if s.local is not None else s.reduced
    if vector is None:
        return None
    summary = summarize_host(vector, vector.norms.tolist(), index)
    return index.name(summary.first_position) if summary.first_position >= 0 else None


def _close(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= JUMP_SAME * max(abs(a), abs(b), 1e-30)


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
