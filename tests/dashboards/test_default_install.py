"""``ddpmon dashboards --write --dir D`` in a default install (no grafana-foundation-sdk): the
dashboards and manifests that ship are written; only ``--config`` needs the SDK, and says so in
one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddpmon.mixin import outputs, shipped
from tests.support.default_install import default_install_env


def dashboards(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpmon.cli", "dashboards", *argv],
                          env=default_install_env(), capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_what_ships_is_what_the_generator_writes() -> None:
    assert shipped.generated_outputs() == outputs.generate()


def test_write_without_the_sdk_writes_the_shipped_files(tmp_path: Path) -> None:
    done = dashboards("--write", "--dir", str(tmp_path))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*")
               if p.is_file()}
    assert written == outputs.generate()
    assert done.stdout.count("wrote ") == len(written)


def test_config_without_the_sdk_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    cfg = tmp_path / "mixin.yml"
    cfg.write_text("dashboard_topk: 3\n")
    done = dashboards("--write", "--dir", str(tmp_path / "out"), "--config", str(cfg))
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "pip install 'ddpmon[dashboards]'" in done.stderr
    assert not (tmp_path / "out").exists()
