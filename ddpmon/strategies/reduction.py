"""The one norm-reduction protocol of the strategies: a float64 vector whose last slot marks a
failure, SUM-reduced on every rank alike, waited on now (``take``) or by the record thread
(``take_later``).

Why each rule (every strategy that reduces norms keeps all of them, so they live here once):

- **Always issued.** A collective is a rendezvous: a rank that skipped it because its own
  measurement failed would leave every peer waiting in it. A failed rank contributes zeros and a
  1 in the failure slot instead, and the failure is raised to its caller after the issue.
- **Zeros, never NaN, for a failed step.** After the sum every rank of the span sees the flag
  and reports zeros (``Issued.or_zeros``), on the device, with no host read. A NaN would read as
  a non-finite gradient and could trigger the skip/raise policy on every rank.
- **Deferred on the host.** On CPU (gloo) waiting on the sum is waiting for the slowest peer to
  reach it: ``take_later`` hands the wait to the record thread (``DeferredReduction``), as NCCL
  keeps it off the host on a GPU, where ``take`` is a stream wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..host_reads import host_read_free

OnError = Callable[[str, BaseException], None]
Measured = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What a measurement gives: the values, or (values, a 0-d failure mark of its own), the mark
of a sum it read (pipeline parallel passes a sharded sum's on)."""
Reduce = Callable[[torch.Tensor], Any]
"""Starts the in-place SUM of a vector over the strategy's groups; returns the work to wait on,
or None when nothing is communicated (the vector is already final)."""


class DeferredReduction:
    """A norm reduction still in flight on the host, finished off the training thread: ``done``
    polls the collective, ``finish`` waits for it and runs the fills (the step's norms from the
    reduced vector; ``also`` adds one). ``finish`` never raises: a failed collective is reported
    and marks the step's reduced norms ``failed``."""

    __slots__ = ("_work", "_fills", "_on_error", "failed")

    def __init__(self, work: Any, fill: Callable[[], Any], on_error: OnError) -> None:
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
class Issued:
    """One issued sum: the vector (values, then the failure slot), the work in flight, and what
    the issuing strategy keeps beside it (``context``)."""

    vector: torch.Tensor
    work: Any
    context: Any = None

    @property
    def values(self) -> torch.Tensor:
        return self.vector[:-1]

    @property
    def failed(self) -> torch.Tensor:
        """0-d device bool: some rank of the span failed (read it on the host only on CPU)."""
        return self.vector[-1] > 0

    def or_zeros(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` where no rank failed, zeros where one did (a device-side choice)."""
        return torch.where(self.failed, torch.zeros_like(values), values)

    def total(self) -> torch.Tensor:
        """``[sum of the values, failed]`` (float64, device): the squared norm over the whole
        vector, as pipeline parallel reads a folded reduction."""
        return torch.stack([self.values.sum(), self.failed.to(torch.float64)])

    def wait(self) -> None:
        """Wait on the sum in flight, if any (a stream wait on NCCL, no host sync)."""
        work, self.work = self.work, None
        if work is not None:
            work.wait()


class FlaggedSum:
    """Issues the flagged sums of one strategy, one in flight at a time; see the module doc."""

    def __init__(self, reduce: Reduce) -> None:
        self._reduce = reduce
        self.pending: Issued | None = None
        """The sum issued since the last ``take`` (None: no backward reduced since)."""

    def issue(
        self,
        measure: Callable[[], Measured],
        width: int,
        device: torch.device,
        context: Any = None,
    ) -> BaseException | None:
        """Measure ``width`` values (``measure``), append the failure slot and start the sum,
        whatever happened in ``measure``. Returns ``measure``'s exception (the caller reports or
        raises it after the collective is safely issued), else None. A sum still in flight from
        an earlier backward of the same step is waited on first."""
        failure: BaseException | None = None
        try:
            measured = measure()
            values, failed = measured if isinstance(measured, tuple) else (measured, None)
            values = values.reshape(-1).to(torch.float64)
            flag = (torch.zeros(1, dtype=torch.float64, device=values.device) if failed is None
                    else failed.reshape(1).to(torch.float64))
            vector = torch.cat([values, flag])
            if vector.numel() != width + 1:
                raise ValueError(f"measured {vector.numel() - 1} values for a sum of {width}")
        except Exception as exc:
            failure = exc
            vector = failed_vector(width, device)
        self.wait()
        self.pending = Issued(vector, None, context)
        self.pending.work = self._reduce(vector)
        return failure

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()

    def take(self) -> Issued | None:
        """The issued sum, waited on, and cleared for the next step; None when nothing was
        issued since the last call."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()
        return pending

    def take_later(
        self, fill: Callable[[Issued], Any], on_error: OnError
    ) -> tuple[Issued, DeferredReduction | None] | None:
        """``take`` without waiting when the sum is still in flight on the host (gloo): the
        returned ``DeferredReduction`` runs ``fill(issued)`` once the collective is done (the
        record thread finishes it). On an accelerator, or with nothing in flight, ``fill`` runs
        now and no deferral is returned. None when nothing was issued."""
        pending = self.pending
        if pending is None:
            return None
        if pending.work is None or not host_read_free(pending.vector.device):
            self.take()
            fill(pending)
            return pending, None
        self.pending = None
        work, pending.work = pending.work, None
        return pending, DeferredReduction(work, lambda: fill(pending), on_error)


def failed_vector(width: int, device: torch.device) -> torch.Tensor:
    """Zero values and the failure mark: what a rank whose measurement failed contributes."""
    vector = torch.zeros(width + 1, dtype=torch.float64, device=device)
    vector[-1] = 1.0
    return vector
