"""Global-norm gradient clipping that is correct for DDP and for sharded parameters, and that
feeds ``ddpmon_grad_norm`` without a second pass over the gradients.

- Replicated (DDP): after the all-reduce every rank holds the same gradients, so the local norm
  *is* the global norm. If a monitor's comm hook already measured the reduced per-parameter
  norms during backward, they are reused: no pass at all.
- Sharded (FSDP-style, each rank owns a disjoint slice): the squared local norm is all-reduced
  (sum) over ``process_group`` before the square root.

Like ``torch.nn.utils.clip_grad_norm_`` it returns the total norm *before* clipping, as a device
tensor, and never reads it on the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .probes.grads import per_param_norms

_active: weakref.ref | None = None


def set_active_monitor(monitor: Any) -> None:
    global _active
    _active = weakref.ref(monitor)


def _active_monitor() -> Any:
    mon = _active() if _active is not None else None
    return mon if mon is not None and getattr(mon, "enabled", False) else None


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    sharded: bool = False,
    process_group: Any = None,
    monitor: Any = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    if float(norm_type) != 2.0:
        raise ValueError(f"ddpmon.clip_grad_norm_: norm_type={norm_type!r}; only 2.0 is supported")
    grads = [p.grad.detach() for p in params]
    # monitor=False: do not feed any monitor (e.g. clipping a second, unrelated group).
    mon = None if monitor is False else (monitor if monitor is not None else _active_monitor())
    total = None
    if mon is not None and not sharded:
        total = mon._reduced_norm_for(params)
    if total is None:
        norms = per_param_norms(grads)
        sq = (norms * norms).sum()
        if sharded:
            import torch.distributed as dist

            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=process_group)
        total = sq.sqrt()
        if mon is not None:
            mon._offer_norms(params, norms, total)
    if error_if_nonfinite and not torch.isfinite(total).item():  # opt-in host read, as in torch
        raise RuntimeError(f"The total norm of gradients is non-finite: {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_type: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_type.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in by_type.items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return total
