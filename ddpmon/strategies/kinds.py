"""Which sharded strategy a model uses, told from the model itself at attach.

``detect_sharded`` returns ``fsdp2``, ``hsdp``, ``tp``, ``fsdp2+tp``, ``hsdp+tp``,
``unsupported:fsdp1`` or None (not sharded: plain or DDP, decided by ``detect``). It reads only
module types and DTensor placements: no collective, no device access.
"""

from __future__ import annotations

import torch

from .dtensor_norms import is_dtensor, is_sharded
from .table import SHARDED

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None  # type: ignore[assignment,misc]

SHARDED_KINDS = SHARDED
"""The sharded rows of :mod:`.table`."""


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_fsdp1(model: torch.nn.Module) -> bool:
    return any(
        type(m).__module__.startswith("torch.distributed.fsdp.fully_sharded_data_parallel")
        for m in model.modules()
    )


def _is_hsdp(param: torch.Tensor) -> bool:
    placements = param.placements
    return len(placements) >= 2 and placements[0].is_replicate() and is_sharded(placements[1])


def detect_sharded(model: torch.nn.Module) -> str | None:
    """The sharded strategy of ``model`` (see the module doc), None when it is not sharded."""
    if _is_fsdp1(model):
        return "unsupported:fsdp1"
    has_fsdp = bool(fsdp_modules(model))
    dtensors = [p for p in model.parameters() if is_dtensor(p)]
    if has_fsdp:
        hsdp = any(_is_hsdp(p) for p in dtensors)
        fsdp_dims = 2 if hsdp else 1
        base = "hsdp" if hsdp else "fsdp2"
        tp = any(p.device_mesh.ndim > fsdp_dims for p in dtensors)
        return f"{base}+tp" if tp else base
    return "tp" if dtensors else None


__all__ = ["SHARDED_KINDS", "detect_sharded", "fsdp_modules"]
