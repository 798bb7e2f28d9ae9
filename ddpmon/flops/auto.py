"""FLOPs per step counted without the user's help: ``FlopCounterMode`` is entered at the model's
forward pre-hook on one early step (after warm-up: compilation, lazy init and the allocator's
first steps are not what the run's steps do) and left at the next step's first forward (or any
forward after the step ended, an evaluation's included), so it sees the whole step: every
micro-batch's forward and backward and the optimizer step.

Shapes: at each training step's first forward a signature of the inputs (shapes and dtypes,
host metadata only: no device read) is compared with the last. A new one is counted again on
its first step; one seen before takes its cached count. Bounded: at most ``recounts`` recounts
and ``max_changes`` changes in all, then the last count is kept and ddpmon says once why
(batches whose shapes change every step: give ``flops_per_step``).

Tokens (or samples) per step come from the counted step's batches: the first tensor input's
leading dims (batch x sequence for integer token ids, else the batch size), summed over its
micro-batches; on a pipeline stage after the first, which is given the previous stage's
activations, from their every dim but the features (:func:`activation_count`).

Never raises into training: a failure is handed to ``on_error`` (counted and logged under the
``mfu`` probe), the mode is left, and counting stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .._torch_compat import exit_dispatch_mode
from .count import flop_counter

log = logging.getLogger("ddpmon.mfu")

Signature = tuple


class AutoCount:
    """A forward pre-hook (``register_forward_pre_hook(auto.forward, with_kwargs=True)``)
    that counts one step's FLOPs and reports ``on_counted(flops, tokens)``."""

    def __init__(self, *, at_step: int, current_step: Callable[[], int],
                 on_counted: Callable[[int, float | None], None],
                 on_error: Callable[[str, BaseException], None],
                 recounts: int = 4, max_changes: int = 16,
                 tokens_of: Callable[[tuple, dict], float] | None = None) -> None:
        self.at_step = at_step
        self.tokens_of = tokens_of or leading_count
        """(args, kwargs) -> tokens or samples of one forward's inputs."""
        """Count on the ``at_step``-th training step this process runs (0-based)."""
        self.current_step, self.on_counted, self.on_error = current_step, on_counted, on_error
        self.recounts, self.max_changes = recounts, max_changes
        self.off = at_step <= 0
        self.cache: dict[Signature, tuple[int, float | None]] = {}
        self.changes = 0
        self.counted_seconds: float | None = None
        """Wall time of the last counted step (FlopCounterMode's cost, with the step)."""
        self.why_stopped: str | None = None
        self._last_step: int | None = None
        self._steps_seen = 0
        self._sig: Signature | None = None
        self._mode: FlopCounterMode | None = None
        self._mode_step = 0
        self._mode_sig: Signature = ()
        self._tokens = 0.0
        self._t0 = 0.0

    # the hook body: one call, one int compare per forward outside the counted step
    def forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.off and self._mode is None:
            return
        try:
            self._forward(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never into training
            self._fail(exc)

    def _forward(self, args: tuple, kwargs: dict) -> None:
        step = self.current_step()
        if self._mode is not None:
            if step == self._mode_step:
                if torch.is_grad_enabled():
                    self._tokens += self.tokens_of(args, kwargs)  # a further micro-batch
                return
            self._finish()
        if self.off or step == self._last_step or not torch.is_grad_enabled():
            return
        self._last_step, self._steps_seen = step, self._steps_seen + 1
        sig = signature(args, kwargs)
        if sig == self._sig or self._steps_seen <= self.at_step:
            return
        if self._sig is not None:
            self.changes += 1
        if sig in self.cache:
            self._sig = sig
            self.on_counted(*self.cache[sig])
        elif len(self.cache) > self.recounts:
            self._stop(f"the batch's shapes changed {self.changes} times, more than "
                       f"{self.recounts} recounts; FLOPs per step stay at the last count")
            return
        else:
            self._start(step, sig, args, kwargs)
        if self.changes >= self.max_changes:
            self._stop(f"the batch's shapes changed {self.changes} times; FLOPs per step stay "
                       "at the last count")

    def _start(self, step: int, sig: Signature, args: tuple, kwargs: dict) -> None:
        mode = flop_counter()
        mode.__enter__()
        self._mode, self._mode_step, self._mode_sig = mode, step, sig
        self._tokens = self.tokens_of(args, kwargs)
        self._t0 = time.perf_counter()

    def _finish(self) -> None:
        """The counted step ended: leave the mode, keep and report its count."""
        mode, self._mode = self._mode, None
        seconds = time.perf_counter() - self._t0
        exit_dispatch_mode(mode.mode, lambda: mode.__exit__(None, None, None))
        flops = int(mode.get_total_flops())
        self._sig = self._mode_sig
        if flops <= 0:
            self._stop("FlopCounterMode counted no FLOPs in a training step (no matmul, "
                       "convolution or attention it knows ran); give flops_per_step")
            return
        self.counted_seconds = seconds
        tokens = self._tokens or None
        self.cache[self._mode_sig] = (flops, tokens)
        log.info("ddpmon: FLOPs per step counted on step %d: %.4g (%s tokens or samples; the "
                 "counted step took %.3f s)", self._mode_step, flops, tokens, seconds)
        self.on_counted(flops, tokens)

    def close(self) -> None:
        """Leave a mode still entered (training ended inside the counted step)."""
        self.off = True
        if self._mode is not None:
            try:
                mode, self._mode = self._mode, None
                exit_dispatch_mode(mode.mode, lambda: mode.__exit__(None, None, None))
            except Exception as exc:  # noqa: BLE001 - never into training
                self.on_error("mfu", exc)

    def _stop(self, why: str) -> None:
        self.off = True
        if self.why_stopped is None:
            self.why_stopped = why
            log.warning("ddpmon: automatic FLOP counting stopped: %s", why)

    def _fail(self, exc: BaseException) -> None:
        self.off = True
        mode, self._mode = self._mode, None
        if mode is not None and mode.mode is not None:
            try:
                exit_dispatch_mode(mode.mode, lambda: mode.__exit__(None, None, None))
            except Exception:  # noqa: BLE001 - the first failure is the one reported
                pass
        self.on_error("mfu", exc)


def _inputs(args: tuple, kwargs: dict) -> list[Any]:
    """Positional inputs, then keyword inputs, one container level deep."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, dict):
            out.extend(a.values())
        elif isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def signature(args: tuple, kwargs: dict) -> Signature:
    """Shapes and dtypes of the tensor inputs (host metadata; no device read)."""
    return tuple((tuple(t.shape), t.dtype) for t in _inputs(args, kwargs)
                 if isinstance(t, torch.Tensor))


def leading_count(args: tuple, kwargs: dict) -> float:
    """Tokens of the first tensor input (batch x sequence for integer token ids), else its
    samples (the batch size); 0 without a tensor input."""
    for t in _inputs(args, kwargs):
        if isinstance(t, torch.Tensor):
            if t.dim() == 0:
                return 0.0
            if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex()):
                return float(t.shape[0] * t.shape[1])
            return float(t.shape[0])
    return 0.0


def activation_count(args: tuple, kwargs: dict) -> float:
    """Tokens of an earlier pipeline stage's activations (the first tensor input): every dim but
    the last, the features (micro-batch x sequence for hidden states ``[b, s, d]``, the batch
    size for ``[b, d]``); 0 without a tensor input."""
    for t in _inputs(args, kwargs):
        if isinstance(t, torch.Tensor):
            if t.dim() < 2:
                return float(t.shape[0]) if t.dim() else 0.0
            return float(t.numel() // max(t.shape[-1], 1))
    return 0.0
