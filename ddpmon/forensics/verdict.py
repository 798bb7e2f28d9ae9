"""The run's verdict: which layer the first failure points at, and the evidence, in one line.

The on-call question after "who failed first" is "what kind of failure": numerics, data supply,
memory, communication, or the hardware itself. The verdict reads the first failure the timeline
picked (``failure.first_failure``) and the events around it:

- ``replica_mismatch``: replicas' parameters differ bit for bit. A step the named rank skipped
  alone since the previous check (``step_skipped``), a mismatch at the first check of an attempt
  (another checkpoint loaded), or every replica differing (a non-deterministic kernel) are bugs
  of the script or its numerics; otherwise the named rank's device is the suspect (hardware).
- ``rerun`` (``on_nonfinite='rerun'``): a transient fault (the step did not reproduce on the
  same batch and RNG state) points at the origin rank's device (hardware); a deterministic one
  at the data or the numerics, with the batch's sample ids.
- ``nonfinite`` (origin), ``loss_scale_floor``: numerics, with the rank, step and tensor. No
  rerun has told a transient fault from a deterministic one, so hardware is not excluded.
- ``oom``: memory. ``stall``: data supply when the rank waited for its batch, else
  communication. ``vanished`` and communication errors: communication.
- an exception, read for its cause (:mod:`.exceptions`): numerics (a clip error, a loss guard,
  anomaly detection), memory (out of memory), data (raised in the data pipeline, with the user's
  frame); a communication error on a peer: communication.
- a signal (SIGTERM: the process was stopped, by a preemption or the launcher) or an exception
  not explained above: the process, with what it was.

Pure function of the timeline's events (no file access): the timeline, ``report`` and the
daemon's job outcome can all carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LAYERS = ("hardware", "numerics", "data", "memory", "communication", "process")


def verdict(first: dict[str, Any] | None, events: list[dict[str, Any]]) -> dict[str, str] | None:
    """``{"layer", "evidence", "line"}`` for the first failure ``first``, or None."""
    if not first:
        return None
    kind, rank, step = first.get("kind"), first.get("rank"), first.get("step")
    at = f"rank {rank}, step {step}"
    if kind == "replica_mismatch":
        layer, evidence = _replicas(first, events)
    elif kind == "rerun":
        layer, evidence = _rerun(first)
    elif kind == "nonfinite":
        what = first.get("param") or first.get("tensor") or "a gradient"
        layer, evidence = "numerics", (
            f"{first.get('nonfinite') or 'non-finite'} first on {at}, in {what}; no rerun told "
            "a transient fault from a deterministic one, so the hardware is not excluded"
        )
    elif kind == "loss_scale_floor":
        layer, evidence = "numerics", f"the loss scale stayed at its floor, {at}"
    elif kind == "oom":
        layer, evidence = "memory", f"out of memory on {at}"
    elif kind == "stall":
        if first.get("phase") == "data":
            layer, evidence = "data", f"{at} waited for its batch past the stall threshold"
        else:
            layer, evidence = "communication", f"{at} stopped making progress" + (
                f" in {first['phase']}" if first.get("phase") else "") + (
                f" at {first['frame']}" if first.get("frame") else "")
    elif kind == "vanished":
        layer, evidence = "communication", f"rank {rank} vanished at step {step}"
    elif kind == "signal":
        frame = f" in {first['frame']}" if first.get("frame") else ""
        stopped = (": the process was stopped (preemption, or the launcher)"
                   if first.get("signal") == "SIGTERM" else "")
        layer, evidence = "process", f"{first.get('signal')} on {at}{frame}{stopped}"
    elif kind == "exit" and first.get("cause") in _EXCEPTION_LAYERS:
        layer, evidence = _exception(first, at)
    elif kind == "exit" and first.get("class") == "consequence":
        layer, evidence = "communication", f"{at}: {first.get('message') or first.get('exc_type')}"
    elif kind == "exit":
        what = first.get("exc_type") or f"exit code {first.get('code')}"
        layer, evidence = "process", f"{what} on {at}"
    else:
        layer, evidence = "process", f"{kind} on {at}"
    return {"layer": layer, "evidence": evidence, "line": f"{layer} ({evidence})"}


_EXCEPTION_LAYERS = ("numerics", "memory", "data")
"""The causes an exception is read for (:mod:`.exceptions`) that name a layer of their own."""


def _exception(first: dict[str, Any], at: str) -> tuple[str, str]:
    """An exception read for its cause: what it was, where, and the user's frame."""
    cause, what = first["cause"], first.get("exc_type") or "an exception"
    phase = f" ({first['phase']})" if first.get("phase") else ""
    message = str(first.get("message") or "").splitlines()
    said = f": {message[0][:160]}" if message else ""
    if cause == "memory":
        return "memory", f"out of memory on {at}{phase}, {what}"
    if cause == "data":
        frame = f", in {first['frame']}" if first.get("frame") else ""
        return "data", f"{what} in the data pipeline on {at}{frame}{said}"
    tensor = f", in {first['tensor']}" if first.get("tensor") else ""
    return "numerics", f"non-finite on {at}{phase}{tensor}: {what}{said}"


def _rerun(first: dict[str, Any]) -> tuple[str, str]:
    rank, step = first.get("rank"), first.get("step")
    gpu, device = first.get("gpu_uuid"), first.get("gpu_uuid") or first.get("device")
    what = "a non-finite gradient" if first.get("trigger") == "nonfinite" else "a norm jump"
    if first.get("fault") == "transient":
        act = f"drain the node and compare {gpu} with DCGM" if gpu else "drain the node"
        return "hardware", (f"transient on rank {rank}" + (f", {device}" if device else "")
                            + f": {what} at step {step} did not reproduce on a rerun of the "
                            f"same batch; {act}")
    ids = format_ids(first.get("sample_ids"), first.get("sample_count"))
    where = f" in {first['param']}" if first.get("param") else ""
    return "numerics", (f"deterministic on rank {rank}: {what} at step {step}{where} reproduced"
                        f" on a rerun" + (f"; batch ids {ids}" if ids else ""))


def _replicas(first: dict[str, Any], events: list[dict[str, Any]]) -> tuple[str, str]:
    rank, step = first.get("rank"), first.get("step")
    ranks = first.get("ranks") or [rank]
    group = first.get("group")
    diverged = f"replicas diverged at step {step}" + (f" in {group}" if group else "")
    attempt = first.get("attempt", 0)
    mine = [e for e in events if e.get("rank") == rank and e.get("attempt", 0) == attempt]
    previous = max((e.get("step") for e in mine if e.get("kind") == "replica_mismatch"
                    and isinstance(e.get("step"), int) and e["step"] < (step or 0)),
                   default=None)
    skipped = [e.get("step") for e in mine if e.get("kind") == "step_skipped"
               and isinstance(e.get("step"), int) and e["step"] <= (step or 0)
               and (previous is None or e["step"] > previous)]
    if skipped:
        return "numerics", (f"rank {rank} alone skipped step {skipped[-1]}: its loop's guard "
                            f"decided on a value only it saw; {diverged}")
    if first.get("first_check"):
        return "numerics", (f"rank {rank} held other weights from the first step of attempt "
                            f"{attempt}: another checkpoint; {diverged}")
    replicas = first.get("replicas")
    if replicas and replicas > 2 and len(ranks) == replicas:
        return "numerics", f"every replica differs: a non-deterministic kernel; {diverged}"
    device = first.get("device")
    where = f"rank {rank}" + (f" ({device})" if device else "")
    others = [r for r in ranks if r != rank]
    tie = f"; no majority, rank {', '.join(map(str, others))} differs too" if others else ""
    return "hardware", f"suspect {where}: silent data corruption; {diverged}{tie}"


def format_ids(ids: Sequence[int] | None, count: int | None = None) -> str:
    """``8812-8815, 9001`` (consecutive runs folded), ``… (N in all)`` when cut."""
    if not ids:
        return ""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
    if count is not None and count > len(ids):
        text += f", … ({count} in all)"
    return text
