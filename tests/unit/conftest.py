"""Fixtures of the world-size-1 unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo world and its 1-D CPU mesh (torn down after the module): a real process
    group, so DTensors have real placements and collectives return a real ``Work``."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
