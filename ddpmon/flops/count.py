"""FLOPs of one training step, counted by ``torch.utils.flop_counter.FlopCounterMode``: the ops
that really ran on this rank (forward and backward, attention variants, the experts a router
chose), gradient accumulation's micro-batches included.

On CPU, the attention kernel's FLOPs are counted with FlopCounterMode's own SDPA formulas
(:func:`cpu_attention`: its registry has the CUDA kernels only).

Shards count their own work. FSDP2 computes on gathered, plain tensors, so the mode sees this
rank's work as it is. Tensor parallelism computes on DTensors, where the mode sees the global
op (its count would be the whole model's, over 100 % MFU on every TP rank): each counted op with
DTensor operands is scaled by the smallest local share of them (a column- or row-parallel matmul,
heads split across ranks, a sequence-parallel input: each rank does that share of the op).

Cost: the counted step runs once under a dispatch mode that inspects every op (a few times
slower than a plain step on CPU); count one step, again when shapes change, never every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from .._torch_compat import raw_flop_formula


def count_flops(step: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``step()`` once under ``FlopCounterMode`` (DTensor ops at this rank's share); return
    its result and the FLOPs counted."""

    mode = flop_counter()
    with mode:
        result = step()
    return result, int(mode.get_total_flops())


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` that counts DTensor ops at this rank's share and the CPU
    attention kernel (not entered)."""
    formulas = {**flop_registry, **cpu_attention()}
    mapping = {op: _local_share(formula) for op, formula in formulas.items()}
    return FlopCounterMode(display=False, custom_mapping=mapping)


def cpu_attention() -> dict[Any, Callable[..., int]]:
    """FlopCounterMode's own SDPA formulas for the CPU attention kernel, which its registry
    lacks (torch 2.13 counts 0 FLOPs for ``scaled_dot_product_attention`` on CPU)."""

    ops = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        def forward(q, k, v, *_: Any, **__: Any) -> int:
            return sdpa_flop_count(q.shape, k.shape, v.shape)

        out[fwd] = raw_flop_formula(forward)
    if bwd is not None:
        def backward(grad, q, k, v, *_: Any, **__: Any) -> int:
            return sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)

        out[bwd] = raw_flop_formula(backward)
    return out


def _local_share(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` (a registered one: it takes the op's raw arguments) times the local share."""

    def counted(*args: Any, **kwargs: Any) -> int:
        flops = formula(*args, **kwargs)
        share = min((s for s in map(_share, _flatten(args)) if s is not None), default=1.0)
        return round(flops * share)

    return raw_flop_formula(counted)


def _share(x: Any) -> float | None:

    if not isinstance(x, DTensor) or x.numel() == 0:
        return None
    return x.to_local().numel() / x.numel()


def _flatten(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flatten(a))
        else:
            out.append(a)
    return out
