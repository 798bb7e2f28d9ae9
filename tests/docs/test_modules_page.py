"""docs/reference/modules.md names every module: a module added without a docstring stops the
generator (and so the reference check), and each row is its docstring's first sentence."""

from __future__ import annotations

import pytest

from ddpmon.reference.modules import PACKAGE, first_sentence, module_lines


def test_every_module_of_the_package_has_its_line():
    rows = dict(module_lines())
    on_disk = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if "__pycache__" not in p.parts and p.read_text().strip()}
    assert set(rows) == on_disk
    assert rows["strategies/registry.py"].startswith("Every strategy ddpmon knows")


def test_a_module_without_a_docstring_is_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")  # empty: skipped
    (tmp_path / "sub" / "said.py").write_text('"""Says what it is. More."""\n')
    (tmp_path / "sub" / "silent.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"sub/silent\.py"):
        module_lines(tmp_path)
    (tmp_path / "sub" / "silent.py").unlink()
    assert module_lines(tmp_path) == [("sub/said.py", "Says what it is.")]


def test_the_first_sentence_is_one_line():
    assert first_sentence("One thing, e.g. this\nwraps. Then more.\n\nSecond para.") == (
        "One thing, e.g. this wraps.")
    assert first_sentence("No full stop") == "No full stop"
