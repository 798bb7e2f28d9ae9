"""Imports inside functions only where they buy something, each with its reason: an optional
dependency (``ddpmon[dashboards]``, ``[report]``, ``[auth]``, ``[daemon]``, DeepSpeed), a
private torch API some builds lack, or a light start of the command line and the daemon,
which import neither torch nor pyarrow. Everything else is imported at the top of its module,
where readers and tools see the graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ddpmon"


def _unexplained(path: Path, root: Path = REPO) -> list[str]:
    """Function-level imports of ``path`` with no comment on their line or above their run of
    imports (one comment may cover consecutive imports)."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    imports = {
        node.lineno: node
        for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    ends = {node.end_lineno: node for node in imports.values()}
    wrong = []
    for lineno in sorted(imports):
        first = lineno
        while True:
            if any("#" in lines[i - 1] for i in range(first, imports[first].end_lineno + 1)):
                break
            above = first - 1
            if above >= 1 and lines[above - 1].strip().startswith("#"):
                break
            if above in ends:  # the import just above: its comment covers this one
                first = ends[above].lineno
                continue
            wrong.append(f"{path.relative_to(root)}:{lineno}: {lines[lineno - 1].strip()}")
            break
    return wrong


def test_every_function_level_import_says_why():
    wrong = [w for path in sorted(PACKAGE.rglob("*.py")) for w in _unexplained(path)]
    assert wrong == []


def test_the_reader_finds_an_unexplained_import(tmp_path):
    """Not vacuous: a bare import inside a function is caught, a commented one passes."""
    bare = tmp_path / "ddpmon_case.py"
    bare.write_text("def f():\n    import json\n    return json\n\n\n"
                    "def g():\n    import bcrypt  # optional: ddpmon[auth]\n    import yaml\n")
    found = _unexplained(bare, tmp_path)
    assert found == ["ddpmon_case.py:2: import json"]


def test_the_command_line_and_the_daemon_start_without_torch():
    code = (
        "import sys, importlib, pkgutil\n"
        "from ddpmon.cli import build_parser\n"
        "build_parser()\n"
        "import ddpmon.daemon\n"
        "for m in pkgutil.iter_modules(ddpmon.daemon.__path__):\n"
        "    importlib.import_module('ddpmon.daemon.' + m.name)\n"
        "print(sorted(m for m in ('torch', 'pyarrow', 'matplotlib') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                          capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stdout
