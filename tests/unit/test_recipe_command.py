"""docs/architecture.md's "Add a command", held: its example, written as a module of
``ddpmon.commands`` (step 1), is listed by the command line after the known commands, then at
its ``ORDER`` place (step 2), runs through ``ddpmon.cli.main`` with its exit status, and the
generated CLI reference page lists it with its argument (step 3)."""

from __future__ import annotations

import sys

import pytest

from ddpmon import cli, commands
from ddpmon.reference.cli import cli_page
from tests.support.recipe_code import recipe_code


@pytest.fixture
def hello(tmp_path, monkeypatch):
    """The recipe's module, ``ddpmon/commands/hello.py``, in a folder the package also reads."""
    folder = tmp_path / "commands"
    folder.mkdir()
    (folder / "hello.py").write_text(recipe_code("Add a command"), encoding="utf-8")
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, "ddpmon.commands.hello", raising=False)
    yield
    sys.modules.pop("ddpmon.commands.hello", None)


def test_a_command_is_its_module(hello, tmp_path, capsys):
    assert cli.available_commands()[-1] == "hello"  # step 1: listed, after the known ones
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.rank0.jsonl").write_text("{}\n")
    (run / "odd\x1b]52;c;bad\x07.txt").write_text("")
    assert cli.main(["hello", str(run)]) == 0
    out = capsys.readouterr().out
    assert "events.rank0.jsonl" in out and "\x1b" not in out  # printed through terminal.py
    assert cli.main(["hello", str(tmp_path / "missing")]) == 2


def test_its_order_place_and_its_reference_entry(hello, monkeypatch):
    monkeypatch.setattr(cli, "ORDER", (*cli.ORDER[:3], "hello", *cli.ORDER[3:]))
    assert cli.available_commands()[3] == "hello"  # step 2
    page = cli_page()  # step 3: what `make reference` writes to docs/reference/cli.md
    assert "hello" in page and "name the files of a run dir" in page and "run_dir" in page


def test_without_the_module_there_is_no_command(capsys):
    """Not vacuous: the shipped command line knows no ``hello``."""
    assert "hello" not in cli.available_commands()
    with pytest.raises(SystemExit):
        cli.main(["hello", "x"])
    capsys.readouterr()
