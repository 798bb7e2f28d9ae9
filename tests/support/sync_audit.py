"""The sync audit: every op that would make the host wait for a GPU, counted by op and thread.

Two recorders, both on while ``SyncAudit`` is entered:

- a ``TorchDispatchMode`` on the entering (training) thread sees every aten op that runs there,
  backward included (autograd runs a CPU backward on the calling thread). It counts the ops
  that read a device value on the host or whose output size depends on device data
  (``SYNC_OPS``), boolean-mask indexing, and copies that CUDA runs as a blocking host copy
  (device->host unless non-blocking into pinned memory; a blocking host->device copy);
- Python-level wrappers on ``torch.Tensor`` count, on *every* thread, what does not dispatch on
  the CPU or runs where the mode is not active: ``tolist``, ``numpy``, ``cpu()``,
  ``to("cpu")``, ``torch.tensor``/``as_tensor`` with a ``device`` (a host->device copy), and,
  off the mode's thread, ``item``/``bool``/``float``/``int`` (a gloo callback's read).

On a CPU-only run every tensor is host memory, so a copy "to the CPU" cannot be told from the
data: the wrappers count the *calls* that are device->host copies when the tensor is on a GPU.
That is why the audit compares a monitored loop with the same loop unmonitored: the loop's own
reads (a GradScaler's ``found_inf`` check) appear in both; whatever the monitored run adds is
ddpmon's. ``DDPMON_SYNC_AUDIT=1`` (ddpmon/host_reads.py) makes ddpmon take its accelerator
branches on the CPU, so the code audited is the code a GPU runs.

Threads named ``ddpmon-*`` (the record drainer, the HTTP server...) read host copies by design;
their counts are kept apart (``ddpmon_threads``), never mixed into the training side.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten

PACKAGE = str(Path(__file__).resolve().parents[2] / "ddpmon")

SYNC_OPS: frozenset[str] = frozenset({
    # a value read on the host: .item(), bool(t), float(t), int(t), torch.equal, allclose
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal",
    # output size from device data (CUDA copies the size to the host and waits)
    "aten.nonzero", "aten.argwhere", "aten.masked_select", "aten.unique_consecutive",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_dim_consecutive",
    "aten.repeat_interleave", "aten.bincount", "aten.histc",
    # linalg's error checks read an info tensor on the host
    "aten._linalg_check_errors",
})
"""Aten ops (overload packets) that synchronize with the device on CUDA whatever their
arguments. torch's CUDA sync debug mode reports each through ``memcpy_and_sync`` or
``stream_synchronize`` (c10/cuda/CUDAFunctions.h)."""

_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
_COPY_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten.copy"})
_SCALAR_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__")
_HOST_METHODS = ("tolist", "numpy")


def _packet(func: Any) -> str:
    return f"aten.{func.overloadpacket.__name__}" if hasattr(func, "overloadpacket") else str(func)


def _is_cpu_target(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(...)`` naming the CPU by name (``"cpu"``). A ``torch.device`` is not
    counted: on a CPU-only run the tensor's own device (``p.to(param.device)``, a device copy
    on a GPU) cannot be told from the host; the CUDA audit (``make gpu-check``) sees those."""
    targets = [kwargs.get("device"), *(args[:1] if args else ())]
    return any(isinstance(t, str) and t.split(":")[0] == "cpu" for t in targets)


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def classify(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name under which an aten call counts as a host sync on CUDA, or None."""
    name = _packet(func)
    if name in SYNC_OPS:
        return name
    if name == "aten.repeat_interleave" and kwargs.get("output_size") is not None:
        return None
    if name in _INDEX_OPS and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        return f"{name}[bool mask]"
    if name in _COPY_OPS:
        return _copy_kind(name, args, kwargs)
    return None


def _copy_kind(name: str, args: tuple, kwargs: dict) -> str | None:
    non_blocking = bool(kwargs.get("non_blocking", args[2] if name != "aten._to_copy"
                                   and len(args) > 2 else False))
    if name == "aten._to_copy":
        src = args[0]
        dst_device = kwargs.get("device") or src.device
        dst_pinned = bool(kwargs.get("pin_memory"))
    else:
        dst, src = args[0], args[1]
        dst_device = dst.device
        dst_pinned = dst.device.type == "cpu" and dst.is_pinned()
    if not isinstance(src, torch.Tensor):
        return None
    src_dev, dst_dev = src.device.type, torch.device(dst_device).type
    if src_dev not in ("cpu", "meta") and dst_dev == "cpu" and not (non_blocking and dst_pinned):
        return f"{name}[device->host]"
    if src_dev == "cpu" and dst_dev not in ("cpu", "meta") and not non_blocking:
        return f"{name}[blocking host->device]"
    return None


def _where() -> str:
    """Where the op came from: the innermost frame outside torch, then the ddpmon frames of
    the stack, innermost first (at most three)."""
    frames = [f for f in traceback.extract_stack()[:-3] if "sync_audit" not in f.filename]
    ours = [f"ddpmon/{f.filename[len(PACKAGE) + 1:]}:{f.lineno} {f.name}"
            for f in reversed(frames) if f.filename.startswith(PACKAGE)][:3]
    inner = next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
    if inner is not None and not inner.filename.startswith(PACKAGE):
        ours.insert(0, f"{Path(inner.filename).name}:{inner.lineno} {inner.name}")
    return " < ".join(ours) or "?"


class _Mode(TorchDispatchMode):
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.audit.recording:
            kind = classify(func, args, kwargs)
            if kind is not None:
                self.audit.record(kind)
        return func(*args, **kwargs)


class SyncAudit:
    """``with SyncAudit() as audit: ...``; counts only while ``audit.recording`` is True (the
    window between the first and the last step), by op, training side and ddpmon's threads
    apart. ``where`` keeps, per op, the places ddpmon's code made it (first few)."""

    def __init__(self) -> None:
        self.training: Counter[str] = Counter()
        self.ddpmon_threads: Counter[str] = Counter()
        self.where: dict[str, Counter[str]] = {}
        self.recording = False
        self._lock = threading.Lock()
        self._mode = _Mode(self)
        self._saved: dict[tuple[Any, str], Any] = {}

    def record(self, kind: str) -> None:
        thread = threading.current_thread().name
        place = _where()
        with self._lock:
            side = self.ddpmon_threads if thread.startswith("ddpmon") else self.training
            side[kind] += 1
            if "ddpmon/" in place and not thread.startswith("ddpmon"):
                self.where.setdefault(kind, Counter())[place] += 1

    def _mode_here(self) -> bool:
        """The mode is on this thread's stack: an op reaches it even under another mode that
        passes ops on (ddpmon's FlopCounterMode on the counted step), so a scalar read there is
        the mode's to count, not the method wrapper's (it would be counted twice)."""
        return any(mode is self._mode for mode in _get_current_dispatch_mode_stack())

    def _wrap(self, owner: Any, name: str, kind: Any) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = original
        audit = self

        def wrapper(*args, **kwargs):
            label = kind(args, kwargs) if callable(kind) else kind
            if label is not None and audit.recording:
                audit.record(label)
            return original(*args, **kwargs)

        wrapper.__name__ = getattr(original, "__name__", name)
        setattr(owner, name, wrapper)

    def __enter__(self) -> SyncAudit:
        T = torch.Tensor
        for name in _HOST_METHODS:
            self._wrap(T, name, f"Tensor.{name}")
        for name in _SCALAR_METHODS:  # the mode sees these on its own thread
            self._wrap(T, name, lambda a, k, n=name: None if self._mode_here()
                       else f"Tensor.{n}")
        self._wrap(T, "cpu", "Tensor.cpu")
        self._wrap(T, "to", lambda a, k: "Tensor.to(cpu)" if _is_cpu_target(a[1:], k) else None)
        for name in ("tensor", "as_tensor"):
            self._wrap(torch, name, lambda a, k, n=name: f"torch.{n}(device=...)"
                       if k.get("device") is not None else None)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.recording = False
        self._mode.__exit__(*exc)
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()

    def report(self) -> dict:
        with self._lock:
            return {
                "training": dict(self.training),
                "ddpmon_threads": dict(self.ddpmon_threads),
                "where": {k: dict(v) for k, v in self.where.items()},
            }


def added_ops(monitored: dict, unmonitored: dict) -> dict[str, int]:
    """The ops the monitored run made more often than the same loop unmonitored."""
    return {op: n - unmonitored.get(op, 0) for op, n in sorted(monitored.items())
            if n > unmonitored.get(op, 0)}


__all__ = ["SYNC_OPS", "SyncAudit", "added_ops", "classify"]
