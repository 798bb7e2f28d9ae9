"""The backend in ``ddpmon_rank_info`` and the manifest is the one in use, for every way of
creating the default group: named (``init_process_group("gloo")``), unnamed
(``init_process_group()``) and from ``init_device_mesh`` (both of which report ``undefined`` and
keep one backend per device type). Each in a fresh interpreter at world size 1."""

from __future__ import annotations

import subprocess
import sys

from tests.support.ports import free_port

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ddpmon.job.identity import detect_identity
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


def test_backend_is_the_one_in_use(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(SCRIPT)
    procs = {}
    for how in ("named", "unnamed", "mesh"):  # at once: each is a fresh interpreter
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
        procs[how] = subprocess.Popen([sys.executable, str(script), how], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for how, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (how, err[-2000:])
        assert out.strip() == "gloo", how
