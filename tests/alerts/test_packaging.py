"""A non-editable install of ddpmon, outside any checkout, carries everything the mixin ships.

The wheel is built from a copy of the working tree (``pip wheel --no-deps``) and installed with
``--no-deps`` into a fresh venv that reuses this environment's site-packages for torch and the
rest (a ``.pth`` line; its editable ``ddpmon`` is not picked up: the venv's own site-packages
comes first and ``.pth`` files of an added path are not processed). Every command then runs
from an empty directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.contract import PROM_DIR, REPO

pytestmark = pytest.mark.timeout(300)
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def _run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240, env=env, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(venv bin dir, empty working directory)``."""
    base = tmp_path_factory.mktemp("pkg")
    src = base / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
        capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        source = REPO / rel
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest, follow_symlinks=False)
    wheels = base / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(src)], base,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("ddpmon-*.whl")
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], base)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    purelib = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base
    ).stdout.strip()
    Path(purelib, "host-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    inst = _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         str(wheel)], base,
    )
    assert inst.returncode == 0, inst.stdout + inst.stderr
    empty = base / "empty"
    empty.mkdir()
    where = _run([str(py), "-c", "import ddpmon.mixin.shipped as s; print(s.__file__); "
                  "print(s.checkout_root())"], empty)
    module, checkout = where.stdout.split()
    assert module.startswith(purelib) and checkout == "None", where.stdout + where.stderr
    return venv / "bin", empty


def test_rules_from_the_wheel_pass_promtool(installed: tuple[Path, Path]) -> None:
    bin_dir, cwd = installed
    ddpmon = str(bin_dir / "ddpmon")
    check = _run([ddpmon, "rules", "--check"], cwd)  # against the copies in the package
    assert check.returncode == 0 and "up to date" in check.stdout, check.stdout + check.stderr
    refused = _run([ddpmon, "rules", "--write"], cwd)
    assert refused.returncode == 2 and "--dir" in refused.stderr
    out = cwd / "rules"
    wrote = _run([ddpmon, "rules", "--write", "--dir", str(out)], cwd)
    assert wrote.returncode == 0, wrote.stderr
    rules = sorted(str(p) for p in out.glob("*.yml"))
    assert len(rules) == 2
    checked = _run([PROMTOOL, "check", "rules", *rules], cwd)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The promtool unit tests ship in the package too, byte for byte the checkout's, as are the
    # rules written from the wheel: test_promtool's run of those tests against those rules holds
    # for the wheel (a second full promtool run here cost 17 CPU-seconds for the same outcome).
    packaged = Path(_run(
        [str(bin_dir / "python"), "-c",
         "import ddpmon.mixin.shipped as s; print(s.path('deploy/prometheus/tests'))"], cwd,
    ).stdout.strip())
    shipped_tests = sorted(p.name for p in (PROM_DIR / "tests").glob("*.yml"))
    assert sorted(p.name for p in packaged.glob("*.yml")) == shipped_tests
    for name in shipped_tests:
        assert (packaged / name).read_bytes() == (PROM_DIR / "tests" / name).read_bytes(), name
    for path in out.glob("*.yml"):
        assert path.read_bytes() == (PROM_DIR / path.name).read_bytes(), path.name
    # One of them still runs from the package, where the tests read ../ddpmon-*.yml.
    shutil.copytree(packaged, out / "tests")
    unit = _run([PROMTOOL, "test", "rules", "agent.yml"], out / "tests")
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_dashboards_and_stack_from_the_wheel(installed: tuple[Path, Path]) -> None:
    bin_dir, cwd = installed
    ddpmon = str(bin_dir / "ddpmon")
    out = cwd / "boards"
    wrote = _run([ddpmon, "dashboards", "--write", "--dir", str(out)], cwd)
    assert wrote.returncode == 0, wrote.stderr
    committed_boards = sorted((REPO / "dashboards").glob("*.json"))
    assert len(committed_boards) >= 2, committed_boards  # run overview and rank detail
    for committed in committed_boards:
        assert (out / "dashboards" / committed.name).read_text() == committed.read_text()
    assert (out / "deploy" / "kubernetes" / "kustomization.yaml").is_file()
    listed = _run([ddpmon, "--help"], cwd)
    assert listed.returncode == 0 and "stack" in listed.stdout
    stack = _run(
        [ddpmon, "stack", "--sd-dir", str(cwd / "sd"), "--prometheus-port", "0",
         "--alertmanager-port", "0", "--for-seconds", "1"], cwd,
    )
    assert stack.returncode == 0, stack.stdout + stack.stderr
    assert "Prometheus   http://127.0.0.1:" in stack.stdout and "stack stopped" in stack.stdout
