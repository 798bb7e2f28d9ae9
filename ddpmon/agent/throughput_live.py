"""Wires :class:`ddpmon.flops.mfu.Throughput` into a monitor: its inputs from ``attach``
(``peak_flops``, ``flops_per_step``, ``tokens_per_step``) or the peak table, its families on the
rank's /metrics, the automatic FLOP counter (:class:`ddpmon.flops.auto.AutoCount`, on the
model's forward pre-hook) and ``mon.count_flops`` to count one step by hand."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..flops.auto import AutoCount
from ..flops.count import count_flops
from ..flops.mfu import Throughput
from ..flops.peaks import dtype_of_precision, lookup

log = logging.getLogger("ddpmon.mfu")


def start_throughput(mon: Any, state: Any) -> Throughput | None:
    """Every rank's throughput collector (None without an endpoint)."""
    if mon.port is None:
        return None
    cfg = mon.config
    with mon.guard("mfu"):
        t = Throughput({"run": mon.ctx.run_id, "rank": str(mon.identity.rank)},
                       lambda: (state.steps_total, state.last_step_timestamp))
        t.set(peak_flops=cfg.peak_flops or table_peak(mon.identity.device, state),
              flops_per_step=cfg.flops_per_step or None,
              tokens_per_step=cfg.tokens_per_step or None)
        mon.exposition.add(t)
        if not cfg.flops_per_step:
            start_auto_count(mon, t)
        return t
    return None


def start_auto_count(mon: Any, t: Throughput) -> AutoCount | None:
    """Count FLOPs per step on an early step, and again when shapes change (closed with ``t``);
    None when ``flops_count_step=0`` or without a model to hook."""
    cfg = mon.config
    model = getattr(mon, "model", None)
    if not cfg.flops_count_step or not isinstance(model, torch.nn.Module):
        return None

    def counted(flops: int, tokens: float | None) -> None:
        t.set(flops_per_step=flops, settle=True,
              tokens_per_step=None if cfg.tokens_per_step else tokens)
        mon.flops_per_step = flops

    auto = AutoCount(at_step=cfg.flops_count_step, current_step=lambda: mon.pipeline.step,
                     on_counted=counted, on_error=mon.guard.error)
    handle = model.register_forward_pre_hook(auto.forward, with_kwargs=True)
    t.on_close.append(lambda: (auto.close(), handle.remove()))
    mon.flops_auto = auto
    return auto


def table_peak(device: str, state: Any) -> float | None:
    """The peak table's figure for this rank's CUDA device and training dtype, if known."""
    if not device.startswith("cuda"):
        return None


    name = torch.cuda.get_device_name(torch.device(device))
    found = lookup(name, dtype_of_precision(getattr(state, "precision", None)) or "")
    return found[0] if found else None


def count_step(mon: Any, step: Callable[[], Any], tokens: float | None) -> Any:
    """Run ``step()`` once under FlopCounterMode and make its FLOPs this rank's per-step count."""

    auto = getattr(mon, "flops_auto", None)
    if auto is not None:
        auto.close()  # counted by hand from now on
    result, flops = count_flops(step)
    mon.flush()  # the counted step is in the state before the rates' baseline is taken
    if mon.throughput is not None and flops > 0:
        mon.throughput.set(flops_per_step=flops, tokens_per_step=tokens)
    mon.flops_per_step = flops
    return result
