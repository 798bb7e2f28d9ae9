"""Who this process is in the job: rank, local rank, world size, node, device, versions."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._version import __version__
from .slurm import task_env


@dataclass(slots=True, frozen=True)
class RankIdentity:
    rank: int
    local_rank: int
    world_size: int
    node: str
    backend: str
    device: str
    pid: int
    gpu_uuid: str = ""

    @property
    def labels(self) -> dict[str, str]:
        return {"rank": str(self.rank)}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw) if raw not in (None, "") else default
    except ValueError:
        return default


def backend_in_use(device: str) -> str:
    """The default group's backend for tensors on ``device``. A group created without naming
    one (``init_device_mesh``, ``init_process_group()``) reports ``undefined`` and keeps one
    backend per device type (``cpu:gloo,cuda:nccl``): the model's device picks it."""

    name = str(dist.get_backend())
    if name != "undefined":
        return name
    try:
        config = str(dist.get_backend_config())
    except (RuntimeError, AttributeError, ValueError):
        return name
    per_device = dict(
        item.split(":", 1) for item in config.split(",") if ":" in item
    )
    kind = device.split(":", 1)[0]
    if kind in per_device:
        return per_device[kind]
    return "/".join(sorted(set(per_device.values()))) or name


def detect_identity(model: torch.nn.Module | None, node: str | None = None) -> RankIdentity:
    """From ``torch.distributed`` when initialised, else torchrun's environment, else Slurm's
    (``srun`` without torchrun: ``SLURM_PROCID``, ``SLURM_NTASKS``), else rank 0 of 1. The local
    rank: ``LOCAL_RANK``, else ``SLURM_LOCALID``, else the rank; the node: ``node``, else
    ``SLURMD_NODENAME``, else the host name."""

    device = "cpu"
    if model is not None:
        for param in model.parameters():
            device = str(param.device)
            break
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = backend_in_use(device)
    else:
        rank = _env_int("RANK", task_env("SLURM_PROCID") or 0)
        world_size, backend = _env_int("WORLD_SIZE", task_env("SLURM_NTASKS") or 1), "none"
    localid = task_env("SLURM_LOCALID")
    local_rank = _env_int("LOCAL_RANK", rank if localid is None else localid)
    return RankIdentity(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        node=node or os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        backend=backend,
        device=device,
        pid=os.getpid(),
    )


def build_versions() -> dict[str, str]:
    cuda = torch.version.cuda or ""
    nccl = ""
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            nccl = ""
    return {
        "version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": cuda,
        "nccl_version": nccl,
        "python_version": platform.python_version(),
    }
