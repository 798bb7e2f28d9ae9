"""Host facts the run dir records about a monitored job: the scaler's state (evidence bundles)
and the manifest's description of the run. Read on the record thread or at close, never per
step on the training thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psutil
import torch

from ..job.slurm import from_environ

if TYPE_CHECKING:
    from .monitor import Monitor


def scaler_state(scaler: Any) -> dict | None:
    """A GradScaler's ``state_dict`` as plain values, or None."""
    if scaler is None:
        return None
    try:
        return {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in scaler.state_dict().items()
        }
    except Exception:
        return None


def states_present(optimizer: Any, scaler: Any) -> frozenset[str]:
    """What a run has to restore from a checkpoint: the model, RNG state and the data position
    every run has; the optimizer and the GradScaler where it has them."""
    have = {"model", "rng", "data_loader"}
    if optimizer is not None:
        have.add("optimizer")
    if scaler is not None:
        have.add("scaler")
    return frozenset(have)


def manifest_extra(mon: Monitor) -> dict:
    """What the manifest says about the run beyond the config: precision, strategy, sizes,
    hosts, attempt and recovery."""
    extra = {}
    extra.update(mon.source.manifest_extra())  # the strategy's own facts

    job = from_environ()
    if job is not None:
        extra["slurm"] = job.manifest()
    return extra | {
        "run_id": mon.run_id,
        "batch_shapes": mon.flow.batch_shapes,
        "precision": mon.precision.label(),
        "precision_detail": mon.precision.manifest(),
        "strategy": mon.strategy,
        "data_version": mon.config.data_version,
        "param_count": sum(getattr(p, "ds_numel", p.numel()) for p in mon.index.params),
        "hosts": mon.ctx.hosts,
        "group_names": mon.index.group_names,
        "attempt": mon.attempt.number,
        "recovery": mon.checkpoints.recovery,
        "data_check": data_check_facts(mon.source, mon.config.data_check_interval),
        "replica_check": replica_check_facts(mon),
    }


def replica_check_facts(mon: Monitor) -> dict:
    """The manifest's ``replica_check``: how often and over which ranks the parameters'
    checksums are compared, or why they are not."""
    every = mon.config.replica_check_every
    if not every:
        return {"every": 0, "off": "replica_check_every is 0"}
    try:
        scope, why_not = mon.source.replica_scope()
    except Exception as exc:
        scope, why_not = None, f"unknown ({exc})"
    if scope is None:
        return {"every": 0, "off": why_not}
    if mon.flow.replicas is None:
        return {"every": 0, "off": "one replica only"}
    return {"every": every, "over": scope.over}


def data_check_facts(source: Any, every: int) -> dict:
    """The manifest's ``data_check``: how often and over which ranks the duplicate-data check
    runs, or why it does not."""
    try:
        over, why_not = source.data_check_scope()
    except Exception as exc:
        over, why_not = None, f"unknown ({exc})"
    if not every:
        return {"every": 0, "off": "data_check_interval is 0"}
    if over is None:
        return {"every": 0, "off": why_not}
    return {"every": every, "over": over}


def start_fields(mon: Monitor) -> dict[str, Any]:
    """The ``start`` event's fields: who this rank is, where it serves, its clock offset to rank
    0 and which attempt of the run it is (the timeline aligns and groups ranks by it)."""
    return dict(
        world_size=mon.ctx.identity.world_size,
        local_rank=mon.ctx.identity.local_rank,
        node=mon.ctx.identity.node,
        pid=mon.ctx.identity.pid,
        device=mon.ctx.identity.device,
        port=mon.port,
        run_id=mon.ctx.run_id,
        strategy=mon.strategy,
        clock_offset_seconds=mon.ctx.clock.get("offset_seconds", 0.0),
        clock_rtt_seconds=mon.ctx.clock.get("rtt_seconds"),
        attempt_source=mon.attempt.source,
        previous_progress=mon.attempt.previous_progress,
        process_start_ts=process_start_ts(),
    )


def process_start_ts() -> float | None:
    """When this process started (``time.time()`` clock): goodput counts initialisation from
    here, not from ``attach`` (imports and the model build come first)."""
    try:

        return round(psutil.Process().create_time(), 3)
    except Exception:  # noqa: BLE001 - a fact, never a failure
        return None
