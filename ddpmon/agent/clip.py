"""Global-norm gradient clipping that is correct for every strategy and that costs no extra pass
where ddpmon already measured the norms.

- The monitor that owns the parameters knows the strategy: under DDP it reuses the comm hook's
  reduced per-bucket norms (no pass at all); under a sharded strategy its source sums the shards'
  partial squares over the right mesh dimensions (one pass, one tiny all-reduce).
- Without a monitor: replicated gradients (the local norm is the global one), or
  ``sharded=True`` (each rank owns a disjoint slice): the squared local norm is all-reduced
  (sum) over ``process_group`` before the square root.

Like ``torch.nn.utils.clip_grad_norm_`` it returns the total norm *before* clipping, as a device
tensor, and never reads it on the host (except with ``error_if_nonfinite``, as torch does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..probes.grads import per_param_norms

MonitorLookup = Callable[[Sequence[torch.Tensor]], Any]
"""The live monitor whose model owns the given parameters, or None."""

_lookup: MonitorLookup | None = None


def set_monitor_lookup(lookup: MonitorLookup) -> None:
    """How ``clip_grad_norm_`` finds the monitor of its parameters: the agent registers its
    registry of live monitors here (``ddpmon.agent.registry``), so clipping imports no layer
    above it. No monitor can exist before the agent is imported, so none is missed."""
    global _lookup
    _lookup = lookup


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
    """``monitor``: the monitor of these parameters' model (default: found by ownership);
    ``monitor=False``: compute without any monitor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    if float(norm_type) != 2.0:
        raise ValueError(f"ddpmon.clip_grad_norm_: norm_type={norm_type!r}; only 2.0 is supported")
    if monitor is None and not sharded and _lookup is not None:
        monitor = _lookup(params)
    if monitor not in (None, False) and getattr(monitor, "enabled", False) and not sharded:
        total = monitor.clip_norm(params)
    else:
        norms = per_param_norms([p.grad.detach() for p in params])
        sq = (norms.to(torch.float64) * norms.to(torch.float64)).sum()
        if sharded:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=process_group)
        total = sq.sqrt()
    if error_if_nonfinite and not torch.isfinite(total).item():  # opt-in host read, as in torch
        raise RuntimeError(f"The total norm of gradients is non-finite: {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_type: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad.detach()
        local = g.to_local() if hasattr(g, "to_local") else g
        by_type.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), group in by_type.items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return total
