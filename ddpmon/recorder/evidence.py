"""Evidence bundles: ``run_path/evidence/rank<R>-step<S>-<kind>/``, written atomically.

Why atomic: evidence is written exactly when a process is in trouble and may be killed at any
moment (a NaN followed by ``raise``, a hang followed by the launcher's SIGKILL). A bundle is built
in a hidden temporary directory next to its final place (``.tmp-rank<R>-<pid>-...``), every file
and the directory are fsynced, and only then is it renamed to its final name. A reader therefore
sees a complete bundle or none; names starting with ``.`` are never bundles, and a new writer
removes temporary directories left by dead processes of its rank.

Contents:
- ``info.json``: ``kind``, ``rank``, ``step``, ``ts``, ``pid``, the caller's ``info`` (what
  happened, e.g. ``param``), ``tensors``: a summary of each tensor (:func:`tensor_summary`),
  ``saved_tensors``: the ones also saved whole, ``files``: the bundle's file list.
- ``records.json``: recent step records (the last 64 given).
- ``extra.json``: e.g. the GradScaler state, when given.
- ``rng.json``: RNG seeds/fingerprints; ``rng_state.pt``: the full generator states.
- ``stacks.txt``: the Python stack of every thread.
- ``<name>.pt``: a tensor, only if it has at most ``tensor_max_elements`` elements or
  ``include_tensors``; ``inputs/<name>.pt`` only with ``include_inputs`` (never otherwise).

Bounded: at most ``max_per_kind`` bundles per kind and rank (counted on disk when the writer is
created, so a restarted rank keeps the bound); later incidents return ``None`` and are left to
the event log. ``write`` never raises into training.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch

from ..rundir.atomic import dumps, publish_dir, synced_open, write_file_synced
from ..rundir.layout import (
    BUNDLE_TMP_RE,
    RunDir,
    bundle_name,
    bundle_tmp_prefix,
    parse_bundle_name,
    safe_kind,
)
from ..rundir.safe_read import load_json
from .rng import rng_fingerprints, rng_states

log = logging.getLogger("ddpmon.evidence")

MAX_RECORDS = 64

__all__ = [
    "EvidenceWriter",
    "all_thread_stacks",
    "bundle_name",
    "list_bundles",
    "parse_bundle_name",
    "read_bundle",
    "tensor_summary",
]


def list_bundles(run_path: Path | str) -> list[Path]:
    """Complete bundles of a run (temporary directories excluded), sorted by name."""
    return RunDir(run_path).bundles()


def tensor_summary(t: Any) -> dict[str, Any]:
    """Shape, dtype, device, element count, NaN/+Inf/-Inf counts and min/max/mean/L2 norm of the
    finite values (``None`` when there are none). Works on any device; reads a few scalars."""

    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__, "repr": repr(t)[:200]}
    t = t.detach()
    out: dict[str, Any] = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).replace("torch.", ""),
        "device": str(t.device),
        "numel": int(t.numel()),
    }
    if t.is_sparse or t.numel() == 0:
        return out
    if not (t.is_floating_point() or t.is_complex()):
        x = t.to(torch.float64)
        out.update(nan=0, posinf=0, neginf=0)
    else:
        x = t.to(torch.float64) if not t.is_complex() else t.abs().to(torch.float64)
        nan = torch.isnan(x)
        posinf = torch.isposinf(x)
        neginf = torch.isneginf(x)
        stats = torch.stack([nan.sum(), posinf.sum(), neginf.sum()]).tolist()
        out.update(nan=int(stats[0]), posinf=int(stats[1]), neginf=int(stats[2]))
    out["inf"] = out["posinf"] + out["neginf"]
    finite = x[torch.isfinite(x)]
    out["finite"] = int(finite.numel())
    if finite.numel():
        vals = torch.stack(
            [finite.min(), finite.max(), finite.mean(), torch.linalg.vector_norm(finite)]
        ).tolist()
        out.update(min=vals[0], max=vals[1], mean=vals[2], finite_norm=vals[3])
    else:
        out.update(min=None, max=None, mean=None, finite_norm=None)
    return {
        k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in out.items()
    }


def all_thread_stacks() -> str:
    """Every Python thread's stack, innermost last, as ``traceback`` formats it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        daemon = ""
        for t in threading.enumerate():
            if t.ident == ident:
                daemon = " daemon" if t.daemon else ""
        parts.append(f'Thread {ident} "{names.get(ident, "?")}"{daemon}:\n')
        parts.append("".join(traceback.format_stack(frame)))
        parts.append("\n")
    return "".join(parts)


class EvidenceWriter:
    """Writes bounded, atomic evidence bundles for one rank."""

    def __init__(
        self,
        run_path: Path | str,
        rank: int,
        *,
        max_per_kind: int = 5,
        tensor_max_elements: int = 4096,
        include_tensors: bool = False,
        include_inputs: bool = False,
        health: Any = None,
    ) -> None:
        self.run = RunDir(run_path)
        self.health = health
        """The agent's write health: told of each failed and written bundle; None: log once."""
        self.root = self.run.evidence_dir
        self.rank = int(rank)
        self.max_per_kind = int(max_per_kind)
        self.tensor_max_elements = int(tensor_max_elements)
        self.include_tensors = bool(include_tensors)
        self.include_inputs = bool(include_inputs)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._warned = False
        try:
            self._scan()
        except Exception as exc:
            self._warn(exc)

    def _scan(self) -> None:
        """Count this rank's bundles per kind; remove temp dirs of this rank's dead processes."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            parsed = parse_bundle_name(entry.name)
            if parsed and parsed[0] == self.rank:
                self._counts[parsed[2]] = self._counts.get(parsed[2], 0) + 1
                continue
            m = BUNDLE_TMP_RE.match(entry.name)
            if m and int(m.group(1)) == self.rank and not _pid_alive(int(m.group(2))):
                shutil.rmtree(entry, ignore_errors=True)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ddpmon evidence writing failed (later failures are silent): %s", exc)

    def count(self, kind: str) -> int:
        return self._counts.get(safe_kind(kind), 0)

    def write(
        self,
        kind: str,
        step: int | None,
        info: dict[str, Any],
        *,
        tensors: dict[str, Any] | None = None,
        records: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
    ) -> Path | None:
        """Write one bundle; return its final path, or None (bound reached, or an error).

        ``inputs`` (the batch) is summarised always but saved whole only with
        ``include_inputs``: raw training data never leaves the process otherwise."""
        kind = safe_kind(kind)
        with self._lock:  # one bundle at a time per rank: bounds and names stay exact
            if self.count(kind) >= self.max_per_kind:
                return None
            try:
                path = self._write(kind, step, info, tensors or {}, records, extra, inputs)
            except Exception as exc:
                # A lost bundle counts toward the bound too: on a full disk every step may
                # want one, and each attempt costs tensors saved and stacks dumped.
                self._counts[kind] = self._counts.get(kind, 0) + 1
                if self.health is not None:
                    self.health.failed("evidence", exc, lost=1, steps=(step,))
                else:
                    self._warn(exc)
                return None
            self._counts[kind] = self._counts.get(kind, 0) + 1
        if self.health is not None:
            self.health.succeeded("evidence")
        return path

    def _write(self, kind, step, info, tensors, records, extra, inputs) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = first = self.run.evidence_bundle(self.rank, step, kind)
        n = 2
        while final.exists():  # the same step and kind twice (e.g. a restarted run)
            final = first.with_name(f"{first.name}-{n}")
            n += 1
        tmp = self.root / f"{bundle_tmp_prefix(self.rank, os.getpid())}{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files: list[str] = []
            summaries = {}
            saved: list[str] = []
            for name, t in tensors.items():
                summaries[name] = _summary_or_error(t)
                if isinstance(t, torch.Tensor) and (
                    self.include_tensors or t.numel() <= self.tensor_max_elements
                ):
                    fname = f"{_safe(name)}.pt"
                    _save_tensor(tmp / fname, t)
                    files.append(fname)
                    saved.append(name)
            input_summaries = {}
            for name, t in (inputs or {}).items():
                input_summaries[name] = _summary_or_error(t)
                if self.include_inputs and isinstance(t, torch.Tensor):
                    (tmp / "inputs").mkdir(exist_ok=True)
                    fname = f"inputs/{_safe(name)}.pt"
                    _save_tensor(tmp / fname, t)
                    files.append(fname)
            if records is not None:
                _write_json(tmp / "records.json", list(records)[-MAX_RECORDS:])
                files.append("records.json")
            if extra is not None:
                _write_json(tmp / "extra.json", extra)
                files.append("extra.json")
            _write_json(tmp / "rng.json", rng_fingerprints())
            files.append("rng.json")
            try:
                with synced_open(tmp / "rng_state.pt") as fh:
                    torch.save(rng_states(), fh)
                files.append("rng_state.pt")
            except Exception:
                pass
            write_file_synced(tmp / "stacks.txt", all_thread_stacks())
            files.append("stacks.txt")
            head = {
                "kind": kind,
                "rank": self.rank,
                "step": step,
                "ts": time.time(),
                "pid": os.getpid(),
                "info": info,
                "tensors": summaries,
                "saved_tensors": saved,
                "inputs": input_summaries,
                "inputs_saved": self.include_inputs and bool(inputs),
                "files": ["info.json", *files],
            }
            _write_json(tmp / "info.json", head)  # last: its presence means the rest is there
            return publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def read_bundle(path: Path | str) -> dict[str, Any]:
    """``info.json`` of a bundle plus ``records``/``extra``/``rng`` when present."""

    path = Path(path)
    out = load_json(path / "info.json")  # in a run dir: hostile (size, FIFO, nesting)
    if not isinstance(out, dict):
        raise ValueError(f"{path / 'info.json'}: not a JSON object")
    for name in ("records", "extra", "rng"):
        f = path / f"{name}.json"
        if f.exists():
            out[name] = load_json(f)
    return out


def _summary_or_error(t: Any) -> dict[str, Any]:
    try:
        return tensor_summary(t)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _save_tensor(path: Path, t: Any) -> None:
    with synced_open(path) as fh:
        torch.save(t.detach().cpu().clone(), fh)


def _write_json(path: Path, obj: Any) -> None:
    write_file_synced(path, dumps(obj, indent=1, sort_keys=False) + "\n")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(name))[:100] or "_"
