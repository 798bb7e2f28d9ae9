"""The rank's recorder (``ddpmon/recorder/``): event log, progress, evidence, crash capture,
stall watchdog and manifest, wired into a monitor. Each part is optional: an unwritable run dir
turns them off with one error line, and metrics are still served."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..job.identity import build_versions
from ..recorder.crash import CrashCapture
from ..recorder.eventlog import EventLog, ProgressFile
from ..recorder.evidence import EvidenceWriter
from ..recorder.manifest import write_run_manifest
from ..recorder.watchdog import StallWatchdog, request_flight_recorder_dump
from .context import RunContext
from .guard import Guard
from .inflight import InFlight

log = logging.getLogger("ddpmon")


@dataclass(slots=True)
class Forensics:
    events: Any = None
    progress: Any = None
    evidence: Any = None
    crash: Any = None
    watchdog: Any = None

    @classmethod
    def open(cls, ctx: RunContext, cfg: Config, guard: Guard) -> Forensics:
        out = cls()
        try:
            ctx.run_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.error(
                "ddpmon: run dir %s is not writable (%s); event log and evidence are off, "
                "metrics still served",
                ctx.run_path,
                exc,
            )
            guard.count("forensics")  # logged just above, with the path
            return out
        rank = ctx.identity.rank
        with guard("forensics"):
            out.events = EventLog(ctx.run_path, rank, health=guard.writes)
        with guard("forensics"):
            out.progress = ProgressFile(ctx.run_path, rank, health=guard.writes)
        with guard("forensics"):
            out.evidence = EvidenceWriter(
                ctx.run_path,
                rank,
                max_per_kind=cfg.evidence_max_per_kind,
                tensor_max_elements=cfg.evidence_tensor_max_elements,
                include_tensors=cfg.evidence_include_tensors,
                include_inputs=cfg.evidence_include_inputs,
                health=guard.writes,
            )
        with guard("forensics"):
            out.crash = CrashCapture(ctx.run_path, rank, out.events).install()
        return out

    def follow(self, flow: Any, incidents: Any, emit: Callable[..., None],
               guard: Guard) -> None:
        """Keep the step in progress where a signal's dump finds it (the live line), and what
        its hooks saw where an exception's exit event is written (:mod:`.inflight`)."""
        if self.crash is not None:
            flow.keep_live(self.crash.live)
            self.crash.in_flight = InFlight(flow, incidents, emit, guard).report
            self.crash.term.flush = exit_flush(flow, guard)

    def emit(self, guard: Guard) -> Callable[..., None]:
        """An ``emit(kind, step, **fields)`` that never raises."""
        events = self.events

        def emit(kind: str, step: int | None, **fields: Any) -> None:
            if events is not None:
                with guard("eventlog"):
                    events.emit(kind, step, **fields)

        return emit

    def watch(
        self, stall_seconds: float, heartbeat, on_stall, guard: Guard, flight_recorder: Path
    ) -> None:
        """Watch for a stall: ``on_stall(idle_seconds)`` reports it, then the collectives'
        flight recorder is asked to dump into ``flight_recorder`` (what each rank was waiting
        on)."""
        with guard("forensics"):
            def stalled(idle_seconds: float) -> None:
                try:
                    on_stall(idle_seconds)
                finally:
                    with guard("watchdog"):
                        request_flight_recorder_dump(flight_recorder)

            self.watchdog = StallWatchdog(stall_seconds, heartbeat=heartbeat, on_stall=stalled)
            self.watchdog.start()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.crash is not None:
            try:
                self.crash.uninstall()
            except Exception:
                pass


def exit_flush(flow: Any, guard: Guard) -> Callable[[float], None]:
    """SIGTERM's flush (:mod:`ddpmon.recorder.term_flush`): the steps whose values are on the
    host become records (no wait for a device or a peer), then each sink that buffers (the
    history's journal) writes them, by ``until`` (``time.monotonic()``)."""

    def flush(until: float) -> None:
        flow.drain(wait=False)
        for sink in flow.sinks:
            sync = getattr(sink, "sync", None)
            if sync is not None:
                with guard(sink.probe):
                    sync(until - time.monotonic())

    return flush


def manifest_writer(ctx: RunContext, cfg: Config, extra: Callable[[], dict], guard: Guard):
    """A callable that builds and writes this rank's manifest (ManifestSink calls it at attach
    and once more)."""

    def write() -> None:
        with guard("manifest"):
            write_run_manifest(
                ctx.run_path,
                identity=ctx.identity,
                config=cfg,
                versions=build_versions(),
                extra=extra(),
            )

    return write
