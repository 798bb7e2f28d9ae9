"""The import layering of docs/architecture.md, read from the source: no module imports a layer
above its own (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpmon"

FORBIDDEN = {
    "export": {"agent", "daemon", "forensics", "commands", "mixin"},
    "strategies": {"agent", "export", "forensics", "daemon", "commands"},
    "probes": {"agent", "export", "forensics", "daemon", "commands", "strategies"},
    "forensics": {"agent", "daemon", "commands"},
    "agent": {"daemon", "commands"},
}
LEAVES = {"damage", "errors", "agent_socket", "safe_read", "_torch_compat", "step_slots"}


def _imports(path: Path) -> set[str]:
    """The ddpmon modules ``path`` imports, as dotted names below ``ddpmon``."""
    rel = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "ddpmon":
                target = node.module.split(".")[1:]
            else:
                continue
            names = [a.name for a in node.names]
            out.update(".".join([*target, n]) if not node.module else ".".join(target)
                       for n in names)
        elif isinstance(node, ast.Import):
            out.update(".".join(a.name.split(".")[1:]) for a in node.names
                       if a.name.split(".")[0] == "ddpmon")
    return {m for m in out if m}


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        layer = rel[0] if len(rel) > 1 else Path(rel[0]).stem
        for target in _imports(path):
            top = target.split(".")[0]
            if top in FORBIDDEN.get(layer, set()):
                wrong.append(f"{'/'.join(rel)} -> {target}")
            if layer in LEAVES and top not in LEAVES:
                wrong.append(f"{'/'.join(rel)} (a leaf) -> {target}")
    assert wrong == []


def test_the_reader_sees_imports():
    """Not vacuous: the parser finds the imports it must judge."""
    found = _imports(PACKAGE / "export" / "scrape.py")
    assert "damage" in found and "metrics" in found, found
    assert "agent_socket" in _imports(PACKAGE / "export" / "registration.py")
