"""What ``attach`` measures when it is handed a wrapper around the strategy's module.

Lightning Fabric's ``fabric.setup(model, optimizer)`` returns a ``_FabricModule`` (around the
strategy's module: ``DistributedDataParallel``, ``FullyShardedDataParallel``, a ``fully_shard``
model) and a ``_FabricOptimizer`` (around the real optimizer). ``unwrap`` hands back the module
and optimizer inside, so a Fabric loop is measured exactly as the bare strategy (Fabric's calls
reach them: its forward calls the strategy's module, its ``step`` the real optimizer's).
``torch.compile`` around a Fabric module is looked through as Fabric itself does.

Any other wrapper type that holds a ``DistributedDataParallel`` is never taken silently for a
plain module: when the DDP module inside holds every trainable parameter it is monitored in its
place (one warning naming the wrapper), else one warning names the wrapper and what is missing.
A bare module on several ranks while Fabric is loaded (attached before ``fabric.setup``) is
warned about once too.
FSDP1, FSDP2 and DTensor parameters are found inside any wrapper by detection itself
(:mod:`.registry` reads ``model.modules()`` and the parameters). Nothing here imports Lightning:
the wrapper classes are looked up in ``sys.modules`` (a Fabric object exists only once it is).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from .registry import detect_strategy

log = logging.getLogger("ddpmon")

FABRIC_MODULES = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")
"""Where ``_FabricModule``/``_FabricOptimizer`` live (the ``lightning`` package and the
standalone ``lightning_fabric``)."""

MISSING_WITHOUT_DDP = (
    "its norms are read at the optimizer step (after any clipping), with no pre-reduction "
    "local norms, no collective timing, no duplicate-data check and no NaN origin"
)

_warned_types: set[str] = set()
"""Wrapper types already warned about in this process (each is named once)."""


def _fabric_classes(name: str) -> tuple[type, ...]:
    found = []
    for module_name in FABRIC_MODULES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _uncompiled(model: Any) -> Any:
    """The module inside ``torch.compile``'s ``OptimizedModule`` (others unchanged)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def unwrap_fabric(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The strategy's module inside a ``_FabricModule`` (also under ``torch.compile``) and the
    optimizer inside a ``_FabricOptimizer``; anything else is returned unchanged."""
    modules = _fabric_classes("_FabricModule")
    if modules:
        inner = _uncompiled(model)
        forward_module = getattr(inner, "_forward_module", None)  # the strategy's module
        if isinstance(inner, modules) and isinstance(forward_module, torch.nn.Module):
            model = _uncompiled(forward_module)
    optimizers = _fabric_classes("_FabricOptimizer")
    if optimizers and isinstance(optimizer, optimizers):
        optimizer = optimizer.optimizer
    return model, optimizer


def _warn_once(wrapper: Any, message: str) -> None:
    name = _type_name(wrapper)
    if name in _warned_types:
        return
    _warned_types.add(name)
    log.warning(message, name)


def unwrap_unknown(model: Any) -> Any:
    """``model``, or the ``DistributedDataParallel`` inside a wrapper ddpmon does not know.

    A DDP module that holds every trainable parameter of the wrapper is monitored instead (the
    wrapper's forward is taken to call it); one that does not is left, with a warning saying
    what the plain measurement lacks.
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, torch.nn.Module) or isinstance(model, ddp_type):
        return model
    inner = next((m for m in model.modules() if isinstance(m, ddp_type)), None)
    if inner is None:
        return model
    held = {id(p) for p in inner.parameters()}
    outside = [p for p in model.parameters() if p.requires_grad and id(p) not in held]
    if not outside:
        _warn_once(model, (
            "ddpmon: attach got a %s wrapping DistributedDataParallel; monitoring the DDP module "
            "inside it (pass that module to attach to silence this). Steps and forward timing "
            "are read from the DDP module's own calls."
        ))
        return inner
    _warn_once(model, (
        "ddpmon: attach got a %s holding DistributedDataParallel and parameters outside it. "
        f"Measured as a plain module, {MISSING_WITHOUT_DDP}. Attach the DDP module itself."
    ))
    return model


def _before_fabric_setup(model: Any) -> bool:
    """A bare module on several ranks of a Fabric script: most likely attached before
    ``fabric.setup`` wrapped it (which ddpmon cannot see from the module)."""
    if not _fabric_classes("_FabricModule") or not isinstance(model, torch.nn.Module):
        return False
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False

    return detect_strategy(model) == "plain"


def unwrap(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The module and optimizer ddpmon measures for what ``attach`` was given (module doc)."""
    model, optimizer = unwrap_fabric(model, optimizer)
    model = unwrap_unknown(model)
    if _before_fabric_setup(model):
        _warn_once(model, (
            "ddpmon: attach got a bare %s on several ranks while Lightning Fabric is in use; "
            "if fabric.setup wraps it, attach what fabric.setup returned (after it). Measured "
            f"as a plain module, {MISSING_WITHOUT_DDP}."
        ))
    return model, optimizer


__all__ = ["MISSING_WITHOUT_DDP", "unwrap", "unwrap_fabric", "unwrap_unknown"]
