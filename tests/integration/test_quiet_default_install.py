"""A healthy run prints nothing (issue 24, part 4): a 2-rank ``ddpmon demo`` with every module
that only an extra installs made unimportable (a default ``pip install ddpmon``) writes not one
byte to stderr (its own, torchrun's and both ranks', which share it), and still writes each
rank's numerics history."""

from __future__ import annotations

import subprocess
import sys

from ddpmon.recorder.history_read import read_history
from tests.support.default_install import default_install_env, extras_only_modules
from tests.support.ports import free_port_pair

STEPS = 12


def test_the_extras_are_really_absent_under_the_default_install_env():
    env = default_install_env()
    modules = extras_only_modules()
    assert {"fastapi", "matplotlib", "lightning", "transformers", "bcrypt"} <= set(modules)
    probe = (
        "import importlib.util, sys\n"
        "gone = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]\n"
        "import pyarrow, torch, ddpmon\n"  # the core ones still import
        "try:\n    import fastapi\nexcept ModuleNotFoundError:\n    pass\n"
        "else:\n    gone.append('fastapi imported')\n"
        "print(gone)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *modules], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_healthy_default_install_demo_writes_nothing_to_stderr(tmp_path):
    port = free_port_pair()
    cmd = [
        sys.executable, "-m", "ddpmon.cli", "demo", "--nproc", "2", "--steps", str(STEPS),
        "--step-delay", "0", "--port", str(port), "--run-dir", str(tmp_path / "runs"),
        "--run-id", "quiet", "--sd-dir", str(tmp_path / "sd"), "--no-progress",
    ]
    done = subprocess.run(cmd, env=default_install_env(), capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    assert "per-rank summary" in done.stdout
    for rank in range(2):
        history = read_history(tmp_path / "runs" / "quiet" / f"history.rank{rank}.arrow")
        assert list(history.columns["step"]) == list(range(STEPS))
