"""The backend in ``ddpmon_rank_info`` and the manifest is the one in use, for every way of
creating the default group: named (``init_process_group("gloo")``), unnamed
(``init_process_group()``) and from ``init_device_mesh`` (both of which report ``undefined`` and
keep one backend per device type). Each in a fresh interpreter at world size 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.ports import free_port

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ddpmon.identity import detect_identity
how = sys.argv[1]
if how == "mesh":
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("cpu", (1,))
elif how == "unnamed":
    dist.init_process_group()
else:
    dist.init_process_group("gloo")
assert dist.get_backend() == ("gloo" if how == "named" else "undefined"), dist.get_backend()
print(detect_identity(torch.nn.Linear(2, 2)).backend)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("how", ["named", "unnamed", "mesh"])
def test_backend_is_the_one_in_use(tmp_path, how):
    script = tmp_path / "group.py"
    script.write_text(SCRIPT)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, str(script), how], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "gloo"
