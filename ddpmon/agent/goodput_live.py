"""The run's goodput, live: rank 0 recomputes it from the run dir (:mod:`ddpmon.forensics.goodput`,
every attempt of the run, every rank's files) on a thread of its own every ``goodput_seconds``,
and its /metrics serves the last result as ``ddpmon_goodput_*``.

Why rank 0 and a thread: the figure is the run's, not a rank's, and reading the histories costs
milliseconds to seconds (linear in the steps the run dir holds); training never waits for it and
a scrape only reads the cached families. Series are bounded: one per bucket plus three."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from .. import metrics as m
from ..forensics.goodput import of_timeline
from ..forensics.timeline import RunDirError, build_timeline
from .checkpoints import NullTimer
from .phases import PhaseTimer
from .throughput_live import count_step, start_throughput

log = logging.getLogger("ddpmon.goodput")


class GoodputLive:
    """A prometheus collector (``collect``) with a ``version`` that moves when a new result
    arrives, so the exposition cache re-renders."""

    def __init__(self, run_path: Path, labels: dict[str, str], interval: float,
                 on_error: Callable[[str, BaseException], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.run_path, self.labels, self.interval = Path(run_path), labels, interval
        self.on_error, self.clock = on_error, clock
        self.version = 0
        self.result: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GoodputLive:
        self._thread = threading.Thread(target=self._run, name="ddpmon-goodput", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def refresh(self) -> None:
        """Recompute once; a failure is counted (probe ``goodput``), never raised."""
        try:

            try:
                g = of_timeline(build_timeline(self.run_path), now=self.clock())
            except RunDirError:
                return  # no events yet
            if g is None:
                return
            self.result = {"buckets": dict(g.buckets), "wall": g.wall_seconds,
                           "goodput": g.goodput, "ettr": g.ettr}
            self.version += 1
        except Exception as exc:  # noqa: BLE001 - never into training
            self.on_error("goodput", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def collect(self) -> Iterator[Any]:

        r = self.result
        if r is None:
            return
        names, values = list(self.labels), list(self.labels.values())
        fam = GaugeMetricFamily(m.GOODPUT_SECONDS.name, m.GOODPUT_SECONDS.help,
                                labels=[*names, "bucket"])
        for bucket, seconds in r["buckets"].items():
            fam.add_metric([*values, bucket], seconds)
        yield fam
        for metric, value in ((m.GOODPUT_WALL, r["wall"]), (m.GOODPUT_RATIO, r["goodput"]),
                              (m.GOODPUT_ETTR, r["ettr"])):
            if value is not None:
                g = GaugeMetricFamily(metric.name, metric.help, labels=names)
                g.add_metric(values, value)
                yield g


def start_figures(mon: Any, state: Any) -> tuple[GoodputLive | None, Any]:
    """Rank 0's live goodput and every rank's throughput collector, both served by /metrics
    and closed with the endpoint."""

    return start_goodput(mon), start_throughput(mon, state)


def start_goodput(mon: Any) -> GoodputLive | None:
    """Rank 0's live goodput, served by its /metrics; None on other ranks, without an endpoint,
    or with ``goodput_seconds=0``."""
    interval = mon.config.goodput_seconds
    if mon.identity.rank != 0 or not interval or mon.port is None:
        return None
    with mon.guard("goodput"):
        live = GoodputLive(mon.ctx.run_dir.path, {"run": mon.ctx.run_id, "rank": "0"}, interval,
                           mon.guard.error)
        mon.exposition.add(live)
        return live.start()
    return None


class FiguresApi:
    """The monitor's methods for goodput phases and FLOPs (a base of ``Monitor``, which gives
    ``_closed``, ``_emit``, ``flow``, ``guard`` and ``throughput``)."""

    _closed: bool
    flops_per_step: int | None = None
    """FLOPs of one step on this rank, once counted (automatically or by :meth:`count_flops`)."""
    flops_auto: Any = None
    """The automatic FLOP counter (``flops.auto.AutoCount``), where one runs."""

    def _phase_timer(self, name: str) -> Any:
        """The goodput half of ``mon.phase`` (``agent.activity.LoopPhases``): a ``phase`` event
        with its seconds, counted by goodput as ``custom_badput_events``."""

        if self._closed:
            return NullTimer()
        return PhaseTimer(name, self._emit, lambda: self.flow.step,  # type: ignore[attr-defined]
                          self.guard.error)  # type: ignore[attr-defined]

    def count_flops(self, step: Callable[[], Any], tokens: float | None = None) -> Any:
        """Run one step (``step()``: forward, backward, optimizer step) under
        ``FlopCounterMode``: its FLOPs become this rank's FLOPs per step (achieved FLOP/s, MFU);
        ``tokens``: what the step processed (tokens/s). Returns ``step()``'s result. Call it on
        one step, and again when shapes change: the counted step runs a few times slower."""
        if self._closed:
            return step()

        return count_step(self, step, tokens)
