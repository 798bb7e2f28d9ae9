"""The loss-scale floor policy: ``on_loss_scale_floor="record" | "raise"``, for every scaler.

The rule: ``loss_scale_floor_steps`` (K) consecutive optimizer steps whose loss scale after the
step is at or below ``loss_scale_floor`` mean fp16 training has stopped making progress. The
K-th such step acts once per episode (a scale above the floor ends the episode):

- ``record``: one ``loss_scale_floor`` event, derived on the record thread from the step records
  (no host read on the hot path); training goes on.
- ``raise``: decided on the training thread at the call that ended the K-th step
  (``scaler.update()`` for a GradScaler, ``engine.step()`` for an engine that decides its own
  steps). It reads the scale after each step on the host (GradScaler: one ``.item()`` per step,
  the documented cost of this mode; an engine's scaler keeps its scale as a host float already).

Why every rank decides alike without a per-step collective: the rule uses only the scale, which
is the same on every rank by construction (a GradScaler under DDP updates from the all-reduced
gradients, ShardedGradScaler all-reduces ``found_inf``, an engine's scaler all-reduces its
overflow flag), so every rank reaches the K-th step at the same step. Only then do the ranks
meet in one ``all_gather_object`` to agree on one message: each rank contributes the steps at
which its own local gradients were the origin of an overflow and the last checkpoint it saved. A
rank whose own contribution fails still joins the collective (its entry then carries the error),
and a failed collective raises with this rank's own facts: no rank is left waiting, and every
rank raises the same ``LossScaleFloorError``.

An engine's own "loss scale already at minimum" exception is the same condition reached by the
engine's rule; its strategy hands it over as an ``EngineFloor`` (``strategies.base``), which
names the event's ``source`` and the error's first sentence: ddpmon records it as a
``loss_scale_floor`` event; under ``raise`` it is re-raised as ``LossScaleFloorError`` chained
from the engine's exception, under ``record`` the engine's exception propagates unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from ..errors import LossScaleFloorError
from ..strategies.base import EngineFloor

log = logging.getLogger("ddpmon")

__all__ = ["FloorStreak", "LossScaleFloorError"]


class FloorStreak:
    """Counts consecutive steps at or below the floor; ``update`` is True at the K-th."""

    def __init__(self, floor: float, steps: int) -> None:
        self.floor = floor
        self.steps = steps
        self.count = 0

    def update(self, scale: float | None) -> bool:
        if scale is None:
            return False  # no scale this step (scaler disabled): the episode is unchanged
        if scale <= self.floor:
            self.count += 1
            return self.count == self.steps
        self.count = 0
        return False


class FloorPolicy:
    """See the module doc. ``origins()``: the recent steps at which this rank's local gradients
    were the origin of a non-finite step; ``checkpoint()``: this rank's last good save."""

    def __init__(
        self,
        *,
        mode: str,
        floor: float,
        steps: int,
        rank: int,
        emit: Callable[..., None],
        origins: Callable[[], Iterable[int]],
        checkpoint: Callable[[], dict | None],
        flush: Callable[[], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.mode = mode
        self.streak = FloorStreak(floor, steps)
        self.rank = rank
        self._emit = emit
        self._origins = origins
        self._checkpoint = checkpoint
        self._flush = flush
        self._on_error = on_error

    @property
    def raises(self) -> bool:
        return self.mode == "raise"

    # ------------------------------------------------------------------ record mode
    def on_record(self, step: int, scale: float | None) -> None:
        """Record thread, ``record`` mode: the event at the K-th step of an episode."""
        if self.mode == "record" and self.streak.update(scale):
            self._emit(
                "loss_scale_floor", step, action="record", source="ddpmon", loss_scale=scale,
                floor=self.streak.floor, steps=self.streak.steps,
                origin_steps=sorted(set(self._origins())), checkpoint=self._checkpoint(),
            )

    # ------------------------------------------------------------------ raise mode
    def after_step(self, step: int, scale: float | None) -> None:
        """Training thread, ``raise`` mode, after each optimizer step; raises at the K-th."""
        if self.mode == "raise" and self.streak.update(scale):
            self._act(step, scale, source="ddpmon", cause=None)

    def engine_floor(self, step: int, floor: EngineFloor) -> None:
        """An engine raised at its own minimum scale (on every rank: its overflow flag is
        all-reduced). Recorded either way; re-raised as ``LossScaleFloorError`` under raise."""
        if self.raises:
            self._act(step, floor.scale, source=floor.source, cause=floor.cause,
                      head=floor.head(step))
        self._emit(
            "loss_scale_floor", step, action="record", source=floor.source,
            loss_scale=floor.scale, floor=self.streak.floor, message=str(floor.cause)[:500],
        )

    def _act(self, step: int, scale: float | None, *, source: str, cause: BaseException | None,
             head: str | None = None):
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            self._flush()  # this rank's records up to this step, origins included
            mine["origin_steps"] = sorted(set(self._origins()))
            mine["checkpoint"] = self._checkpoint()
        except Exception as exc:  # still joins the collective below
            mine["error"] = f"{type(exc).__name__}: {exc}"
            self._on_error("floor", exc)
        entries, gather_error = _gather(mine)
        origin_ranks = sorted(e["rank"] for e in entries if e.get("origin_steps"))
        checkpoint = _last_checkpoint(entries)
        message = _message(step, scale, self.streak, head, entries, origin_ranks, checkpoint,
                           gather_error, cause)
        self._emit(
            "loss_scale_floor", step, action="raise", source=source, loss_scale=scale,
            floor=self.streak.floor, steps=self.streak.steps, origin_ranks=origin_ranks,
            origin_steps=mine.get("origin_steps"), checkpoint=checkpoint, message=message,
        )
        error = LossScaleFloorError(message, step=step, loss_scale=scale,
                                    origin_ranks=origin_ranks, checkpoint=checkpoint)
        if cause is not None:
            raise error from cause
        raise error


def _gather(mine: dict) -> tuple[list[dict], str | None]:
    """Every rank's entry, in rank order (one ``all_gather_object``); only this rank's when the
    job is not distributed or the collective fails."""
    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [mine], None
        entries: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(entries, mine)
        return [e if isinstance(e, dict) else {"rank": i} for i, e in enumerate(entries)], None
    except Exception as exc:
        return [mine], f"{type(exc).__name__}: {exc}"


def _last_checkpoint(entries: list[dict]) -> dict | None:
    """The newest save every rank reported (the smallest step among ranks' last saves: each
    rank's last save may be a different attempt at the same step), else rank 0's."""
    saves = [e.get("checkpoint") for e in entries]
    if saves and all(isinstance(s, dict) for s in saves):
        return min(saves, key=lambda s: s.get("step", 0))
    return next((s for s in saves if isinstance(s, dict)), None)


def _fmt_scale(scale: float | None) -> str:
    return "unknown" if scale is None else f"{scale:g}"


def _message(step, scale, streak, head, entries, origin_ranks, checkpoint, gather_error,
             cause) -> str:
    if head is None:  # ddpmon's own rule (an engine's floor brings its own first sentence)
        head = (f"ddpmon: loss scale {_fmt_scale(scale)} at or below loss_scale_floor="
                f"{streak.floor:g} for {streak.steps} consecutive steps, at step {step}")
    if origin_ranks:
        per = "; ".join(
            f"rank {e['rank']} at steps {_steps(e['origin_steps'])}"
            for e in entries if e.get("origin_steps")
        )
        origins = f"overflow origin ranks: {origin_ranks} ({per})"
    else:
        origins = "overflow origin ranks: none seen (no rank's local gradients were non-finite)"
    if checkpoint:
        ckpt = f"last good checkpoint: step {checkpoint.get('step')} at {checkpoint.get('path')}"
    else:
        ckpt = "last good checkpoint: none recorded (use mon.observe_checkpoint)"
    parts = [head, origins, ckpt]
    failed = [e for e in entries if e.get("error")]
    if failed:
        parts.append("facts missing from rank(s) " + ", ".join(str(e["rank"]) for e in failed))
    if gather_error:
        parts.append(f"other ranks' facts unavailable ({gather_error})")
    return "; ".join(parts)


def _steps(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[-limit:])
    return shown if len(steps) <= limit else f"..., {shown}"
