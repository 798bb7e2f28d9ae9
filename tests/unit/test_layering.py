"""The import layering of docs/architecture.md, read from the source: every package and every
module of ``ddpmon/`` sits in one layer, and none imports a layer above its own or beside it
(imports inside functions included). A new module fails here until it is given its layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpmon"
ROOT = "__init__"
"""The package root (``ddpmon/__init__.py``: ``attach``, ``Config``), as a unit."""

LAYERS: list[tuple[str, frozenset[str]]] = [
    ("leaves: nothing of ddpmon's", frozenset({
        "_version", "_torch_compat", "errors", "terminal", "host_reads", "rundir", "sources",
        "web",
    })),
    ("names and who: the metric catalogue (with its types, step metrics and state), the job",
     frozenset({"metrics", "job"})),
    ("built on the catalogue", frozenset({"mixin"})),
    ("options and device probes", frozenset({"config", "probes", "services", "flops"})),
    ("strategies", frozenset({"strategies"})),
    ("what runs inside training and writes the run dir", frozenset({"export", "recorder"})),
    ("the readers of a run dir, after training (and live goodput)", frozenset({"forensics"})),
    ("the agent", frozenset({"agent"})),
    ("the public API", frozenset({ROOT})),
    ("users of the API", frozenset({"integrations", "demo"})),
    ("the node daemon", frozenset({"daemon"})),
    ("commands", frozenset({"commands"})),
    ("the command line", frozenset({"cli"})),
    ("the reference pages", frozenset({"reference"})),
]
APART = {"export": {"mixin"}}
"""Pairs the layers would allow that must still never meet: the endpoint serves, it does not
generate rules."""


def _unit(path: Path) -> str:
    """The package (``agent``) or top-level module (``clip``) that ``path`` belongs to."""
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else Path(rel[0]).stem


def _is_module(parts: list[str]) -> bool:
    where = PACKAGE.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The ddpmon modules ``path`` imports, as dotted names below ``ddpmon`` (``__init__`` for
    the package root: ``import ddpmon``, ``from ddpmon import attach``, ``from .. import x``)."""
    package = list(path.relative_to(PACKAGE).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "ddpmon":
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = [*target, alias.name]
                named = sub if _is_module(sub) else target
                out.add(".".join(named) or ROOT)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ddpmon":
                    out.add(".".join(parts[1:]) or ROOT)
    return out


def _layer_of() -> dict[str, int]:
    return {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def test_every_package_and_module_has_a_layer():
    layer = _layer_of()
    units = {_unit(path) for path in PACKAGE.rglob("*.py")}
    assert sorted(units - layer.keys()) == [], "give these a layer in LAYERS"
    assert sorted(layer.keys() - units) == [], "these are gone: take them out of LAYERS"
    assert sum(len(units) for _, units in LAYERS) == len(layer), "a unit is in two layers"


def test_no_module_imports_a_layer_above_or_beside_its_own():
    layer = _layer_of()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        for target in _imports(path):
            top = target.split(".")[0]
            if top == unit:
                continue
            if layer.get(top, len(LAYERS)) >= layer[unit] or top in APART.get(unit, ()):
                wrong.append(f"{path.relative_to(PACKAGE)} -> {target}")
    assert wrong == []


def test_the_reader_sees_imports():
    """Not vacuous: the parser finds the imports it must judge, the package root's included."""
    found = _imports(PACKAGE / "export" / "scrape.py")
    assert "rundir.damage" in found and "metrics" in found, found
    assert "web.agent_socket" in _imports(PACKAGE / "export" / "registration.py")
    assert ROOT in _imports(PACKAGE / "demo" / "train.py")
    assert "agent" in _imports(PACKAGE / "__init__.py")  # the lazy attach, inside a function


LOOSE = 8
"""At most this many modules directly in ``ddpmon/`` (the package root counted): everything
else lives in a package named for its job (docs/architecture.md)."""


def test_few_modules_sit_loose_in_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= LOOSE, loose
STRATEGY_DOORS = frozenset({
    "strategies.base", "strategies.registry", "strategies.attach_args", "strategies.precision",
    "strategies.replicas", "strategies.block_entry", "strategies.dtensor_norms",
})
"""What ``agent/`` may import of ``strategies/``: the extension point (``base``), the registry,
what attach's arguments mean, and helpers every strategy shares; never a strategy itself (its
subpackage or source module). A strategy reaches the agent through its source, passed in."""
# Literal words, as `grep -ril` reads them: the agent's own parts use other names too.
STRATEGY_WORDS = ("deepspeed", "fsdp", "pipeline", "pipelining", "pp_probes")


def test_the_agent_names_no_strategy():
    wrong = []
    for path in sorted((PACKAGE / "agent").rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        wrong += [f"{rel} -> {t}" for t in sorted(_imports(path))
                  if t.startswith("strategies") and t not in STRATEGY_DOORS]
        text = path.read_text().lower()
        wrong += [f"{rel}: {word}" for word in STRATEGY_WORDS if word in text]
    assert wrong == []
