"""Tokens/s (this rank's share of its batch: its tokens over the ranks that train on it, so a
run's sum counts each batch once), achieved FLOP/s and MFU of one rank, computed at scrape time
from host values the agent already keeps (steps completed, when the last one completed) and the
FLOPs per step (counted once, or given). Nothing runs per step, so the hot path gains no work
and no sync.

An MFU over 100 % cannot be right (FLOPs per step counted on another shape, a peak for another
dtype or device, steps counted twice): it is never exported, and the agent says once why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from .. import metrics as m

log = logging.getLogger("ddpmon.mfu")


class Throughput:
    """A prometheus collector (``collect``, ``version``) for one rank's FLOPs and MFU."""

    def __init__(self, labels: dict[str, str], progress: Callable[[], tuple[int, float]],
                 peak_flops: float | None = None, flops_per_step: float | None = None,
                 tokens_per_step: float | None = None, tokens_shared_by: int = 1) -> None:
        self.labels = labels
        self.progress = progress
        """() -> (steps completed, wall time of the last one)."""
        self.peak_flops = peak_flops
        self.flops_per_step = flops_per_step
        self.tokens_per_step = tokens_per_step
        """The tokens of this rank's batch as it reads them (counted or given)."""
        self.tokens_shared_by = max(int(tokens_shared_by), 1)
        """The ranks that train on that batch (TP x PP): this rank exports its share."""
        self.version = 0
        self.refused: str | None = None
        self._since: tuple[int, float] | None = (progress()[0], time.time())
        self._settle_after = 0
        self.on_close: list[Callable[[], None]] = []
        """Called by :meth:`close` (the automatic FLOP counter's hook)."""

    def set(self, *, flops_per_step: float | None = None, tokens_per_step: float | None = None,
            peak_flops: float | None = None, settle: bool = False) -> None:
        """New inputs (a recount after a shape change); rates restart from now, or with
        ``settle`` (set from a hook, where the steps read back may trail the loop) from the first
        scrape that sees a step completed after this call."""
        for name, v in (("flops_per_step", flops_per_step), ("tokens_per_step", tokens_per_step),
                        ("peak_flops", peak_flops)):
            if v is not None:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                    raise ValueError(f"{name}={v!r}: expected a number > 0")
                setattr(self, name, float(v))
        self._since = None if settle else (self.progress()[0], time.time())
        self._settle_after = self.progress()[0]
        self.refused = None
        self.version += 1

    def close(self) -> None:
        for close in self.on_close:
            close()

    def rates(self) -> dict[str, float]:
        """``steps_per_second`` since the inputs were set, and what follows from it."""
        steps, last = self.progress()
        if self._since is None:  # settling: a consistent (steps, time of the last) baseline
            if steps > self._settle_after:
                self._since = (steps, last)
            return {}
        steps0, t0 = self._since
        if steps <= steps0 or last <= t0:
            return {}
        out = {"steps_per_second": (steps - steps0) / (last - t0)}
        if self.tokens_per_step:
            share = self.tokens_per_step / self.tokens_shared_by
            out["tokens_per_second"] = share * out["steps_per_second"]
        if self.flops_per_step:
            out["flops_per_second"] = self.flops_per_step * out["steps_per_second"]
            if self.peak_flops:
                mfu = out["flops_per_second"] / self.peak_flops
                if mfu > 1.0:
                    self._refuse(mfu)
                else:
                    out["mfu"] = mfu
        return out

    def _refuse(self, mfu: float) -> None:
        if self.refused is None:
            self.refused = (
                f"MFU {100 * mfu:.0f}% is impossible ({self.flops_per_step:.4g} FLOPs per step x "
                f"{self.flops_per_step and mfu * self.peak_flops / self.flops_per_step:.3g} "
                f"steps/s over a peak of {self.peak_flops:.4g} FLOP/s): the peak is for another "
                "device or dtype, or the FLOPs per step were counted on other shapes; not "
                "exported (set peak_flops, or count the FLOPs again)")
            log.warning("ddpmon: %s", self.refused)

    def collect(self) -> Iterator[Any]:

        names, values = list(self.labels), list(self.labels.values())
        r = self.rates()
        for metric, v in ((m.FLOPS_PER_STEP, self.flops_per_step),
                          (m.PEAK_FLOPS, self.peak_flops),
                          (m.TOKENS_PER_SECOND, r.get("tokens_per_second")),
                          (m.ACHIEVED_FLOPS, r.get("flops_per_second")),
                          (m.MFU, r.get("mfu"))):
            if v is not None:
                fam = GaugeMetricFamily(metric.name, metric.help, labels=names)
                fam.add_metric(values, v)
                yield fam
