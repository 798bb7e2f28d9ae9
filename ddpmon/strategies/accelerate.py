"""What ddpmon takes from an ``accelerate.Accelerator``: its GradScaler and its setup.

``ddpmon.attach(model, optimizer, accelerator=accelerator)`` calls ``parts_from_accelerator``
(users import these from ``ddpmon.integrations.accelerate``; they live beside ``wrappers.py``
because the agent reads them and imports no integration).
Accelerate is never imported here: the functions read public attributes of the objects they
are given, so ``import ddpmon`` stays free of it and a missing attribute degrades to a default.
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict

import torch

from .._torch_compat import scaler_enabled


class AcceleratorParts(TypedDict):
    """The parts of an Accelerator that ``attach`` uses."""

    scaler: Any
    """``torch.amp.GradScaler`` for fp16 mixed precision, else None."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step: ddpmon counts optimizer steps, not micro-batches."""
    mixed_precision: str
    """``no``, ``fp16``, ``bf16`` or ``fp8`` as Accelerate names it."""
    distributed_type: str
    """Accelerate's ``DistributedType`` value, e.g. ``MULTI_GPU``, ``MULTI_CPU``, ``FSDP``."""
    num_processes: int
    process_index: int


def parts_from_accelerator(accelerator: Any) -> AcceleratorParts:
    """Read the scaler and the distributed setup from ``accelerator`` (no device access).

    Raises ``TypeError`` with a precise message when ``accelerator`` is not an Accelerator.
    """
    if not hasattr(accelerator, "gradient_state") or not hasattr(accelerator, "prepare"):
        raise TypeError(
            "ddpmon: accelerator= must be an accelerate.Accelerator, got "
            f"{type(accelerator).__module__}.{type(accelerator).__qualname__}"
        )
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and not scaler_enabled(scaler):
        scaler = None  # a disabled scaler neither scales nor skips
    distributed = getattr(accelerator, "distributed_type", "NO")
    return AcceleratorParts(
        scaler=scaler,
        gradient_accumulation_steps=int(getattr(accelerator, "gradient_accumulation_steps", 1)),
        mixed_precision=str(getattr(accelerator, "mixed_precision", "no")),
        distributed_type=str(getattr(distributed, "value", distributed)),
        num_processes=int(getattr(accelerator, "num_processes", 1)),
        process_index=int(getattr(accelerator, "process_index", 0)),
    )


def deepspeed_engine(accelerator: Any, model: Any) -> Any | None:
    """The ``DeepSpeedEngine`` Accelerate prepared, when ``model`` is that engine or the module
    inside it (``accelerator.unwrap_model(model)``); else None. Under DeepSpeed the callbacks
    and loops hold the unwrapped module and Accelerate's optimizer wrapper (whose ``step`` is a
    no-op): ddpmon measures through the engine, which Accelerate keeps at
    ``accelerator.deepspeed_engine_wrapped.engine``."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = getattr(wrapped, "engine", None)
    if engine is None:
        return None
    if model is engine or model is getattr(engine, "module", None):
        return engine
    return None


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (others unchanged).

    Step hooks must go on the inner optimizer: the wrapper never runs torch's optimizer hooks,
    and it calls the inner ``step`` only on the micro-batch that ends a gradient-accumulation
    window (through the GradScaler with fp16), so hooks there fire once per optimizer step.
    """
    module = sys.modules.get("accelerate.optimizer")
    wrapper = getattr(module, "AcceleratedOptimizer", None) if module is not None else None
    if wrapper is not None and isinstance(optimizer, wrapper):
        inner = optimizer.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer
