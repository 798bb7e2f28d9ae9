"""The ``ddpmon`` command lists exactly the commands whose module exists, and a missing optional
extra is one line that names the extra."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon import cli, commands

COMMANDS_DIR = Path(commands.__file__).parent


def _listed(parser: argparse.ArgumentParser) -> set[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_lists_exactly_the_command_modules() -> None:
    on_disk = {p.stem for p in COMMANDS_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert _listed(cli.build_parser()) == on_disk
    for planned in ("report", "compare"):
        assert (planned in on_disk) == (planned in _listed(cli.build_parser()))


def test_a_new_command_module_is_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another engineer adds ``ddpmon/commands/compare.py``: it is listed, in documented order."""
    extra = tmp_path / "commands"
    extra.mkdir()
    (extra / "zzz_probe.py").write_text(
        "def register(sub):\n    sub.add_parser('zzz_probe', help='probe')\n"
    )
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(extra)])
    assert "zzz_probe" in cli.available_commands()
    assert cli.available_commands()[-1] == "zzz_probe"  # unknown names go last
    assert "zzz_probe" in _listed(cli.build_parser())


def test_missing_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    """Regenerating dashboards for your own config needs the SDK (writing the shipped ones does
    not: tests/dashboards/test_default_install.py)."""
    config = tmp_path / "mixin.yaml"
    config.write_text("stall_seconds: 900\n")
    out = tmp_path / "out"
    code = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"
        "from ddpmon.cli import main\n"
        f"sys.exit(main(['dashboards', '--write', '--dir', {str(out)!r}, "
        f"'--config', {str(config)!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'dashboards'" in lines[0] and "pip install 'ddpmon[dashboards]'" in lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_unknown_missing_module_is_not_hidden() -> None:
    exc = ModuleNotFoundError("No module named 'nothere'", name="nothere")
    assert cli.missing_extra(exc) is None
    assert cli.missing_extra(ModuleNotFoundError("x", name="fastapi.routing")) == "daemon"
