"""Which event of a run is its first failure: the classes of ``ddpmon.forensics.timeline``'s
module doc (origin, vanished, stall, consequence), then time within a class, and how the run
ended. Pure functions over merged, clock-aligned events."""

from __future__ import annotations

from typing import Any

from .entry import nearest_entry
from .exceptions import REACTIONS, read_exception

SECONDARY_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP"}


def first_failure(events: list[dict[str, Any]], fr: dict[int, dict]) -> dict[str, Any] | None:
    ranked = []
    floor = any(_floor_stopped(e) for e in events)
    downstream = saw_only_reduced(events)
    for e in events:
        tier = failure_tier(e, floor_stopped=floor)
        if tier is None:
            continue
        sub = 0.0
        if e.get("kind") == "stall":
            enq = fr.get(e.get("rank"), {}).get("last_enqueued_collective")
            enq = enq if enq is not None else _default_group_sequence(e)
            sub = float(enq) if enq is not None else float("inf")
        else:
            tier, sub = exit_order(e, tier, downstream)
        ranked.append(((tier, sub, e["t"]), e))
    if not ranked:
        return None
    ranked.sort(key=lambda x: x[0])
    e, tied = nearest_entry(ranked[0][1], events)
    out = {
        "rank": e.get("rank"), "step": e.get("step"), "kind": e.get("kind"), "ts": e.get("ts"),
        "t": e.get("t"), "t_rel": e.get("t_rel"), "class": TIER_NAMES[ranked[0][0][0]],
    }
    if e.get("kind") == "stall" and fr:
        out["flight_recorder"] = {str(r): v.get("last_enqueued_collective") for r, v in fr.items()}
    for key in ("param", "tensor", "nonfinite", "origin", "signal", "signum", "where", "action",
                "exc_type", "message", "code", "idle_seconds", "detail", "phase", "frame",
                "attempt", "source", "loss_scale", "origin_ranks", "checkpoint", "stage",
                "microbatch", "site", "ranks", "group", "replicas", "device",
                "first_check", "trigger", "fault", "gpu_uuid", "sample_ids", "sample_count",
                "batch", "cause", "running", "collective", "entry",
                "entry_depth"):
        if key in e:
            out[key] = e[key]
    if tied:
        out["tied_ranks"] = tied
    return out


def _default_group_sequence(stall: dict[str, Any]) -> int | None:
    """The stall event's own sequence number on the default group (``"0"``) where no flight
    recorder dump says it: the rank behind it stopped first (docs/slow-and-stuck/hangs.md)."""
    sequences = stall.get("sequences")
    seq = sequences.get("0") if isinstance(sequences, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def read_exits(events: list[dict[str, Any]]) -> None:
    """Add ``cause`` (and ``frame``, ``tensor`` where told) to each exception ``exit`` event,
    read from its type, message and traceback (:mod:`.exceptions`); fields a damaged or
    hostile event claims for these are replaced."""
    for e in events:
        if e.get("kind") == "exit" and e.get("reason") == "exception":
            for key in ("cause", "frame", "tensor"):
                e.pop(key, None)
            e.update(read_exception(e.get("exc_type"), e.get("message"), e.get("traceback")))


def exit_order(e: dict[str, Any], tier: int, downstream: set[tuple]) -> tuple[int, float]:
    """``(tier, order within the tier)`` of an exception ``exit`` among failures of its class:
    a non-finite exception is a reaction to a value the hooks may have seen, so the hooks'
    evidence (a local non-finite gradient) comes first, and on a rank whose own gradients were
    finite (``downstream``: :func:`saw_only_reduced`) it is a consequence of a peer's; a lost
    peer or a timeout comes after the signal that stopped that peer. Other events: unchanged."""
    if e.get("kind") != "exit" or e.get("reason", "exception") != "exception":
        return tier, 0.0
    cause = e.get("cause") or read_exception(e.get("exc_type"), e.get("message"))["cause"]
    if cause == "numerics":
        return (3 if _key(e) in downstream else tier), 1.0
    return tier, (1.0 if tier == 3 else 0.0)


def _key(e: dict[str, Any]) -> tuple:
    return e.get("rank"), e.get("attempt", 0), e.get("step")


def saw_only_reduced(events: list[dict[str, Any]]) -> set[tuple]:
    """(rank, attempt, step) where the rank's own gradients were finite but the reduced ones
    were not (its ``nonfinite`` event names no origin): what it raised reacted to a peer."""
    origin = {_key(e) for e in events if e.get("kind") == "nonfinite" and e.get("origin") is True}
    return {_key(e) for e in events if e.get("kind") == "nonfinite"
            and e.get("origin") is False and not e.get("poisoned")} - origin


TIER_NAMES = {0: "origin", 1: "vanished", 2: "stall", 3: "consequence"}


def _floor_stopped(e: dict[str, Any]) -> bool:
    """A ``loss_scale_floor`` event that stops the run: ddpmon's ``raise`` or DeepSpeed's own
    exception at its minimum scale."""
    return e.get("kind") == "loss_scale_floor" and (
        e.get("action") == "raise" or e.get("source") == "deepspeed"
    )


def failure_tier(e: dict[str, Any], *, floor_stopped: bool = False) -> int | None:
    """0 origin, 1 vanished, 2 stall, 3 consequence, None: not a failure (see module doc).

    ``floor_stopped``: the loss-scale floor stopped the run; it is then the failure, and the
    overflows the scaler absorbed before it (named in its event) and the exception it raised
    are its consequences."""
    kind = e.get("kind")
    if kind == "loss_scale_floor":
        return 0 if _floor_stopped(e) else 3
    if floor_stopped and kind == "nonfinite" and e.get("skipped_by") == "scaler":
        return 3
    if kind == "nonfinite":
        where = str(e.get("where", "")).lower()
        if e.get("origin") is True:
            return 0
        # The agent's skip/raise decisions read the reduced gradients: identical on all ranks.
        decided = e.get("action") in ("skip", "raise")
        return 3 if e.get("origin") is False or decided or where in ("reduced", "global") else 0
    if kind == "signal":
        return 3 if str(e.get("signal")) in SECONDARY_SIGNALS else 0
    if kind in ("oom", "replica_mismatch"):
        return 0
    if kind == "rerun":  # the rank named in the event is the origin; the others reran with it
        return 0 if e.get("origin") is True and e.get("action") != "apply" else None
    if kind == "exit":
        reason = e.get("reason")
        if reason == "exception":
            text = f"{e.get('exc_type', '')} {e.get('message', '')}"
            if e.get("exc_type") in REACTIONS:
                return 3  # on_nonfinite / on_loss_scale_floor = raise: a reaction
            if floor_stopped and "loss scale already at minimum" in text:
                return 3  # DeepSpeed's own, recorded as loss_scale_floor first
            cause = e.get("cause") or read_exception(
                e.get("exc_type"), e.get("message"), e.get("traceback"))["cause"]
            return 3 if cause == "communication" else 0
        code = e.get("code")
        if reason == "keyboard_interrupt":
            return 3
        return None if code in (0, None, "0") else 0
    if kind == "vanished":
        return 1
    if kind == "stall":
        return 2
    if kind in ("overflow", "scale_floor", "thread_exception"):
        return 3
    return None


def ending(events: list[dict[str, Any]]) -> str:
    for e in reversed(events):
        kind = e.get("kind")
        if kind == "signal":
            return f"signal {e.get('signal')}"
        if kind == "exit":
            errors = [x for x in events
                      if x.get("kind") == "exit" and x.get("reason") == "exception"]
            if errors:
                return f"exception {errors[-1].get('exc_type')}"
            if e.get("reason") == "close":
                return "closed (mon.close)"
            return f"exit code {e.get('code')}"
        if kind == "vanished":
            return "vanished (no exit event: killed, os._exit, or still running)"
        if kind == "stall":
            return "stalled (no exit event after the stall: still hung, or killed while hung)"
    return "unknown"
