"""What Slurm tells a task about itself and its allocation, read from its environment.

Under ``srun python train.py`` (no torchrun) a task knows its rank, local rank, world size and
node only from ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURMD_NODENAME``;
``identity.detect_identity`` falls back to them after torchrun's variables, so torchrun's values
win inside an allocation. The job labels the run either way: the run id defaults to the job id
(``<array job>_<array task>`` for an array), the attempt follows ``SLURM_RESTART_COUNT`` (a
requeue), and the manifest records the allocation. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SAFE = re.compile(r"^[A-Za-z0-9._,\[\]():=+-]{1,256}$")
"""What a Slurm value may look like to be recorded or used as a label (nothing else is)."""


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    step_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    user: str | None = None
    partition: str | None = None
    name: str | None = None
    allocation: tuple[tuple[str, str], ...] = ()
    """Nodes, tasks per node, GRES...: (field, value) pairs as Slurm gave them."""

    @property
    def run_id(self) -> str:
        """The job id, or ``<array job>_<array task>`` for an array task (Slurm's own
        spelling): every task of the job computes the same one, with no collective."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def labels(self) -> dict[str, str]:
        """Target labels for discovery: job, user, partition (those Slurm gave)."""
        out = {"slurm_job": self.run_id}
        if self.user:
            out["slurm_user"] = self.user
        if self.partition:
            out["slurm_partition"] = self.partition
        return out

    def manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"job_id": self.job_id, "run_id": self.run_id,
                               "restart_count": self.restart_count}
        for key in ("step_id", "array_job_id", "array_task_id", "user", "partition", "name"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        doc["allocation"] = dict(self.allocation)
        return doc


ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"})
"""Slurm job states after which nothing of the job runs."""


def ended(state: str | None) -> bool:
    """``state`` (``scontrol``'s, or ``sacct``'s such as "CANCELLED by 0") is an end."""
    return bool(state) and state.split(" ")[0] in ENDED


ALLOCATION = (
    ("nodes", "SLURM_JOB_NODELIST"),
    ("num_nodes", "SLURM_JOB_NUM_NODES"),
    ("tasks", "SLURM_NTASKS"),
    ("tasks_per_node", "SLURM_TASKS_PER_NODE"),
    ("cpus_per_task", "SLURM_CPUS_PER_TASK"),
    ("gpus", "SLURM_GPUS"),
    ("gpus_per_node", "SLURM_GPUS_PER_NODE"),
    ("gpus_on_node", "SLURM_GPUS_ON_NODE"),
    ("gres", "SLURM_JOB_GRES"),
    ("tres_per_task", "SLURM_TRES_PER_TASK"),
    ("cluster", "SLURM_CLUSTER_NAME"),
)
"""Manifest field -> the variable it comes from, recorded when present."""


def from_environ(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The job this process runs in, or None outside Slurm (or with an unreadable job id)."""
    env = os.environ if environ is None else environ
    job_id = _safe(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    if job_id is None:
        return None
    restarts = _int(env.get("SLURM_RESTART_COUNT"))
    return SlurmJob(
        job_id=job_id,
        step_id=_safe(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")),
        array_job_id=_safe(env.get("SLURM_ARRAY_JOB_ID")),
        array_task_id=_safe(env.get("SLURM_ARRAY_TASK_ID")),
        restart_count=restarts if restarts is not None else 0,
        user=_safe(env.get("SLURM_JOB_USER")),
        partition=_safe(env.get("SLURM_JOB_PARTITION")),
        name=_safe(env.get("SLURM_JOB_NAME")),
        allocation=tuple((key, value) for key, var in ALLOCATION
                         if (value := _safe(env.get(var))) is not None),
    )


def task_env(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` as an int (None: absent)."""
    env = os.environ if environ is None else environ
    return _int(env.get(name))


def restart_count(environ: Mapping[str, str] | None = None) -> int | None:
    """``SLURM_RESTART_COUNT``: how often Slurm requeued this job (None outside Slurm)."""
    env = os.environ if environ is None else environ
    return _int(env.get("SLURM_RESTART_COUNT")) if env.get("SLURM_JOB_ID") else None


def _safe(value: str | None) -> str | None:
    return value if value is not None and _SAFE.match(value) else None


def _int(value: str | None) -> int | None:
    try:
        number = int(value) if value not in (None, "") else None
    except ValueError:
        return None
    return number if number is None or number >= 0 else None
