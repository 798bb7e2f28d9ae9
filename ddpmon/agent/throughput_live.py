"""Wires :class:`ddpmon.flops.mfu.Throughput` into a monitor: its inputs from ``attach``
(``peak_flops``, ``flops_per_step``, ``tokens_per_step``) or the peak table, its families on the
rank's /metrics, the automatic FLOP counter (:class:`ddpmon.flops.auto.AutoCount`, on the
model's forward pre-hook) and ``mon.count_flops`` to count one step by hand.

Tokens/s is this rank's share: the ranks that train on the same batch (peers that split a batch's
layers or its tensors) and where the batch is read come from the strategy
(``GradientSource.batch_share``), so the agent names none."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..flops.auto import AutoCount, activation_count, leading_count
from ..flops.count import count_flops
from ..flops.mfu import Throughput
from ..flops.peaks import dtype_of_precision, lookup
from ..strategies.base import BatchShare

log = logging.getLogger("ddpmon.mfu")


def start_throughput(mon: Any, state: Any) -> Throughput | None:
    """Every rank's throughput collector (None without an endpoint)."""
    if mon.port is None:
        return None
    cfg = mon.config
    with mon.guard("mfu"):
        share = batch_share(mon)
        t = Throughput({"run": mon.ctx.run_id, "rank": str(mon.identity.rank)},
                       lambda: (state.steps_total, state.last_step_timestamp),
                       tokens_shared_by=share.ranks)
        t.set(peak_flops=cfg.peak_flops or table_peak(mon.identity.device, state),
              flops_per_step=cfg.flops_per_step or None,
              tokens_per_step=cfg.tokens_per_step or None)
        mon.exposition.add(t)
        if not cfg.flops_per_step:
            start_auto_count(mon, t, share)
        return t
    return None


def batch_share(mon: Any) -> BatchShare:
    """The strategy's ranks sharing this rank's batch; this rank alone if it cannot say."""
    try:
        share = mon.source.batch_share()
    except Exception as exc:  # noqa: BLE001 - tokens/s then counts this rank's batch whole
        mon.guard.error("mfu", exc)
        return BatchShare()
    if share.ranks > 1:
        log.info("ddpmon: tokens/s is this rank's share of its batch, shared by %d ranks (%s)",
                 share.ranks, share.over)
    return share


def start_auto_count(mon: Any, t: Throughput, share: BatchShare | None = None
                     ) -> AutoCount | None:
    """Count FLOPs per step on an early step, and again when shapes change (closed with ``t``),
    at the module where the strategy says the batch is read; None when
    ``flops_count_step=0`` or without a model to hook."""
    cfg = mon.config
    share = share or BatchShare()
    model = share.reads_at if share.reads_at is not None else getattr(mon, "model", None)
    if not cfg.flops_count_step or not isinstance(model, torch.nn.Module):
        return None

    def counted(flops: int, tokens: float | None) -> None:
        t.set(flops_per_step=flops, settle=True,
              tokens_per_step=None if cfg.tokens_per_step else tokens)
        mon.flops_per_step = flops

    auto = AutoCount(at_step=cfg.flops_count_step, current_step=lambda: mon.flow.step,
                     on_counted=counted, on_error=mon.guard.error,
                     tokens_of=activation_count if share.activations else leading_count)
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
