"""How a job ended: per-rank exit codes/signals from the launcher's result file, failure events
from the run's event logs, and which failure came first.

torchrun stops the surviving ranks with SIGTERM once one rank fails, so those terminations are
consequences, not causes: they rank after every other failure when choosing the first one. So do
a peer's communication errors ("Connection closed by peer"): the event log's failures are ranked
by the timeline's own classes (``forensics.failure.failure_tier``). Time only orders failures of
one class, and torchrun's timestamps are whole seconds (``ProcessFailure`` truncates
``time.time()``), so a peer's exception logged 0.3 s after a SIGSEGV can carry the earlier time.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from ..forensics.failure import exit_order, failure_tier, saw_only_reduced
from ..forensics.timeline import build_timeline
from ..rundir.layout import EVENTS_RE, RunDir
from ..rundir.safe_read import json_lines, load_json

log = logging.getLogger("ddpmon.daemon")

FAILURE_EVENT_KINDS = frozenset(
    {"nonfinite", "scale_floor", "stall", "oom", "signal", "exception", "thread_exception", "crash"}
)
_EVENT_SCAN_LIMIT = 200_000  # lines per file: bounded work on a huge log


def read_result(path: Path) -> dict[str, Any] | None:
    """The launcher's result file, or None when it is missing or damaged (a job's directory is
    writable by the job: treat it as hostile)."""
    try:
        doc = load_json(path, max_bytes=4 << 20)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def event_failures(run_path: Path) -> list[dict[str, Any]]:
    """Failure-like events in ``events.rank<R>.jsonl`` files; the earliest few per rank."""
    found: list[dict[str, Any]] = []
    for log in RunDir(run_path).ranked(EVENTS_RE).values():
        per_file = absorbed = 0  # absorbed overflows have their own quota: a floor follows
        try:
            for event in json_lines(log, max_line=64 << 10, max_lines=_EVENT_SCAN_LIMIT):
                if per_file >= 5:
                    break
                # a torn last line of a killed rank, or a line of another shape: skipped
                if not isinstance(event, dict) or not _is_failure(event):
                    continue
                if _absorbed(event):
                    absorbed += 1
                    if absorbed > 5:
                        continue
                else:
                    per_file += 1
                found.append(_from_event(event))
        except OSError:  # unreadable (or not a regular file): its failures are not known
            continue
    return found


def _absorbed(event: dict[str, Any]) -> bool:
    """A non-finite step the loss scaler skipped (routine under fp16)."""
    return event.get("kind") == "nonfinite" and event.get("skipped_by") == "scaler"


def _is_failure(event: dict[str, Any]) -> bool:
    kind = event.get("kind")
    if not isinstance(kind, str):
        return False
    if kind == "loss_scale_floor":  # the floor policy or DeepSpeed stopped the run
        return event.get("action") == "raise" or event.get("source") == "deepspeed"
    if kind in FAILURE_EVENT_KINDS:
        return True
    if kind == "exit":
        code = event.get("code", event.get("exit_code", 0))
        return code not in (0, None, "0", "")
    return False


def _scalar(value: Any) -> Any:
    """A value from a job's file as the job record keeps it: a number, a short string, or
    None (a nested value of another shape is dropped, never stored or compared)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:500]
    return None


def _from_event(event: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "event_log"}
    if isinstance(event.get("source"), str):  # who raised it (a floor: ddpmon or deepspeed)
        out["raised_by"] = _scalar(event["source"])
    for key in ("ts", "rank", "step", "kind"):
        out[key] = _scalar(event.get(key))
    sig = _scalar(event.get("signal", event.get("signum")))
    if isinstance(sig, str):
        try:
            sig = int(signal.Signals[sig if sig.startswith("SIG") else f"SIG{sig}"])
        except KeyError:
            sig = None
    if isinstance(sig, int):
        out["signal"] = sig
    for key in ("param", "origin", "nonfinite", "exc_type", "message", "code", "exit_code",
                "skipped_by", "reason", "where", "action"):
        if key in event:
            out[key] = _scalar(event[key])
    return out


def _tier(failure: dict[str, Any], floor_stopped: bool = False) -> float:
    """The timeline's class of a failure (0 origin, 1 vanished, 2 stall, 3 consequence)."""
    sig = failure.get("signal")
    if failure.get("source") != "event_log":  # torchrun's view: an exit code or a signal
        if sig == signal.SIGTERM:
            return 3  # what torchrun sends to the survivors
        if sig in (signal.SIGKILL, signal.SIGINT, signal.SIGHUP):
            return 1
        return 0
    view = dict(failure)
    if isinstance(sig, int):  # the timeline's rules read signal names
        view["signal"] = _signal_name(sig)
    if failure.get("raised_by") is not None:
        view["source"] = failure["raised_by"]
    tier = failure_tier(view, floor_stopped=floor_stopped)
    return 0 if tier is None else tier


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


VERDICT_EVENT_BYTES = 256 << 20
"""Event logs (all ranks together) beyond which the daemon does not build a job's timeline: the
timeline holds every event, and a job's files must not exhaust the daemon (``ddpmon timeline``
still reads them)."""


def run_verdict(run_path: Path) -> dict[str, str] | None:
    """The verdict ``ddpmon timeline`` ends with (``forensics.verdict``), from the job's run
    dir; None when it has none, cannot be read or its event logs are over
    :data:`VERDICT_EVENT_BYTES` (logged, never raised)."""

    try:
        if not run_path.is_dir():
            return None
        size = sum(_size(f) for f in RunDir(run_path).ranked(EVENTS_RE).values())
        if size > VERDICT_EVENT_BYTES:
            log.warning("no verdict for %s: its event logs hold %d bytes, over %d",
                        run_path, size, VERDICT_EVENT_BYTES)
            return None
        return build_timeline(run_path).verdict
    except Exception:
        log.exception("the verdict of %s could not be read", run_path)
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def first_failure(failures: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cause: earliest non-termination failure; ties prefer the event log (precise ts)."""
    candidates = [f for f in failures if isinstance(f.get("ts"), (int, float))]
    if not candidates:
        return None

    floor = any(f.get("kind") == "loss_scale_floor" for f in candidates)
    explained = _explained_exits(candidates, floor)
    logged = [f for f in candidates if f.get("source") == "event_log"]
    downstream = saw_only_reduced(logged)

    def key(f: dict[str, Any]) -> tuple[float, float, float, int]:
        tier, sub = _tier(f, floor), 0.0
        if f.get("source") != "event_log" and f.get("signal") is None:
            tier = explained.get(f.get("rank"), tier)
        elif f.get("source") == "event_log":  # the timeline's order within a class
            tier, sub = exit_order(f, int(tier), downstream)
        return (tier, sub, float(f["ts"]), 0 if f.get("source") == "event_log" else 1)

    return dict(min(candidates, key=key))


def _explained_exits(failures: list[dict[str, Any]], floor: bool) -> dict[Any, float]:
    """Rank -> the class of the exception its own event log records: torchrun sees only the exit
    code of a rank that raised a peer's communication error, the rank's log says it was one."""
    found: dict[Any, float] = {}
    for f in failures:
        if f.get("source") == "event_log" and f.get("kind") == "exit":
            found[f.get("rank")] = min(found.get(f.get("rank"), 3), _tier(f, floor))
    return found
