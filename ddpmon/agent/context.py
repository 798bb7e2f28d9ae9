"""Who this rank is and which run it belongs to, settled once at attach.

Identity (rank, local rank, world size, node, device, GPU UUID), the run id every rank agrees on
(explicit > torchrun's ``TORCHELASTIC_RUN_ID`` > the Slurm job's id > one id broadcast from rank
0), this rank's clock
offset to rank 0 and every rank's host (for rank 0's manifest). The collectives here run once,
in the same order on every rank, inside ``attach``.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ConfigError, label_problem
from ..job.identity import RankIdentity, detect_identity
from ..job.slurm import from_environ
from ..recorder.clock import measure_clock_offset
from ..recorder.rng import rng_fingerprints
from ..rundir.layout import RunDir
from .guard import Guard


@dataclass(slots=True)
class RunContext:
    identity: RankIdentity
    run_id: str
    run_path: Path
    run_dir: RunDir
    clock: dict[str, Any] = field(default_factory=dict)
    hosts: list[dict] | None = None

    @classmethod
    def establish(cls, model: torch.nn.Module, config: Config, guard: Guard) -> RunContext:
        identity = _with_gpu_uuid(detect_identity(model, config.node))
        candidate = config.run_id
        if not candidate:
            elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
            candidate = elastic if elastic and elastic != "none" else None
        if not candidate:
            job = from_environ()
            candidate = job.run_id if job is not None else None
        _check_labels(candidate, identity.node)
        clock: dict[str, Any] = {}
        hosts = None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if candidate is None:
                box = [_new_run_id()]
                dist.broadcast_object_list(box, src=0)
                candidate = box[0]
            with guard("clock"):
                clock = measure_clock_offset()
            with guard("forensics"):
                gathered: list = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, _host_entry(identity))
                hosts = gathered
        run_id = candidate or _new_run_id()
        run_dir = RunDir(Path(config.run_dir) / run_id)
        return cls(identity, run_id, run_dir.path, run_dir, clock, hosts)


def _check_labels(run_id: str | None, node: str) -> None:
    """A run id from torchrun's or Slurm's environment and the node name become labels,
    file names and terminal text like ``run_id=`` does: the same rules (``config.label_problem``),
    checked before any collective, so every rank refuses alike."""

    for what, value in (("TORCHELASTIC_RUN_ID (the run id)", run_id), ("node name", node)):
        problem = None if value is None else label_problem(value, 253)
        if problem is not None:
            raise ConfigError(f"{what} {value!r}: {problem}")


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _host_entry(ident: RankIdentity) -> dict[str, Any]:
    return {
        "rank": ident.rank,
        "node": ident.node,
        "local_rank": ident.local_rank,
        "pid": ident.pid,
        "device": ident.device,
        "gpu_uuid": ident.gpu_uuid or None,
        "rng": rng_fingerprints(),
    }


def _with_gpu_uuid(identity: RankIdentity) -> RankIdentity:
    if not identity.device.startswith("cuda"):
        return identity
    try:
        index = torch.device(identity.device).index or 0
        value = str(torch.cuda.get_device_properties(index).uuid)
        if value and not value.startswith("GPU-"):
            value = "GPU-" + value
        return replace(identity, gpu_uuid=value)
    except Exception:
        return identity
