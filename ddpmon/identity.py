"""Who this process is in the job: rank, local rank, world size, node, device, versions."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

import torch

from . import __version__


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


def detect_identity(model: torch.nn.Module | None, node: str | None = None) -> RankIdentity:
    """From ``torch.distributed`` when initialised, else torchrun's environment, else rank 0/1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    else:
        rank, world_size, backend = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), "none"
    local_rank = _env_int("LOCAL_RANK", rank)
    device = "cpu"
    if model is not None:
        for param in model.parameters():
            device = str(param.device)
            break
    return RankIdentity(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        node=node or socket.gethostname(),
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
