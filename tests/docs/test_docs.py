"""The docs site: it builds strictly, its examples run, and its reference pages are the code's.

Each generated page is checked twice: the committed copy equals what the code generates now,
and a change to the page's source (made here, in a copy or in-process) makes that check fail
for exactly that page, so a stale page cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ddpmon.reference as reference
from ddpmon import metrics
from ddpmon.mixin import shipped
from ddpmon.recorder import event_kinds, history_schema
from ddpmon.reference import catalogues, rules
from ddpmon.rundir import catalogue as rundir_catalogue
from tests.support.alert_contract import alerts_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(<!-- fragment -->\n)?```(?:python|py)\n(.*?)```", re.S)


def python_blocks() -> list[tuple[str, bool, str]]:
    """``(page:line, is_fragment, code)`` of every Python code block of the README and docs."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", bool(m.group(1)), m.group(2)))
    return found


def build_docs(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the docs under ``root``, as ``make docs`` runs it: without
    ``-q``, which would hide the warnings that ``--strict`` turns into a failure."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root, capture_output=True, text=True, timeout=240, env=env,
    )


def docs_warnings(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if "WARNING" in line]


def test_mkdocs_build_is_strict_clean(tmp_path):
    done = build_docs(ROOT, tmp_path / "site")
    assert done.returncode == 0 and not docs_warnings(done), done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_docs_build_fails_on_a_broken_link(tmp_path):
    """The check above can fail: a copy of the docs with one anchor broken on purpose does."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", copy / "docs")
    page = copy / "docs" / "prometheus.md"
    page.write_text(
        page.read_text(encoding="utf-8") + "\nSee [nowhere](dashboards.md#no-such-anchor).\n",
        encoding="utf-8",
    )
    done = build_docs(copy, tmp_path / "site")
    assert done.returncode != 0, "a broken anchor must fail the strict build"
    assert any("no-such-anchor" in line for line in docs_warnings(done)), done.stdout + done.stderr


def test_every_page_is_in_the_nav():
    def leaves(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [leaf for value in node.values() for leaf in leaves(value)]
        return [leaf for item in node for leaf in leaves(item)]

    nav = set(leaves(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(pages - nav)
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


@pytest.mark.parametrize(
    ("where", "fragment", "code"),
    [b for b in python_blocks() if not b[1]],
    ids=[b[0] for b in python_blocks() if not b[1]],
)
def test_complete_python_examples_run(where, fragment, code, tmp_path):
    (tmp_path / "example.py").write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=180, env=env,
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"
    assert done.stderr == "", f"{where} wrote to stderr:\n{done.stderr}"


def test_fragments_are_marked_and_still_python():
    blocks = python_blocks()
    assert any(not fragment for _, fragment, _ in blocks), "no runnable example left"
    for where, fragment, code in blocks:
        if fragment:
            ast.parse(code, filename=where)  # a fragment may not run, but it must be Python


# -- generated pages ---------------------------------------------------------------------------
def stale_pages() -> set[str]:
    generated = reference.generate()
    return {
        rel for rel, text in generated.items()
        if (ROOT / rel).read_text(encoding="utf-8") != text
    }


def _copy_prometheus_dir(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the shipped files that ``shipped.path`` will read instead of the checkout."""
    shutil.copytree(shipped.root() / shipped.PROMETHEUS_DIR, tmp_path / shipped.PROMETHEUS_DIR)
    monkeypatch.setattr(shipped, "root", lambda: tmp_path)
    return tmp_path / shipped.PROMETHEUS_DIR


def _change_alert(tmp_path, monkeypatch):
    folder = _copy_prometheus_dir(tmp_path, monkeypatch)
    doc = yaml.safe_load((folder / "ddpmon-alerts.yml").read_text())
    doc["groups"][0]["rules"][0]["for"] = "7m"
    (folder / "ddpmon-alerts.yml").write_text(yaml.safe_dump(doc))


def _change_runbook(tmp_path, monkeypatch):
    folder = _copy_prometheus_dir(tmp_path, monkeypatch)
    path = folder / "runbook.md"
    path.write_text(path.read_text().replace("**Mitigation.**", "**Mitigation (changed).**", 1))


def _change_recording_rule(tmp_path, monkeypatch):
    folder = _copy_prometheus_dir(tmp_path, monkeypatch)
    doc = yaml.safe_load((folder / "ddpmon-rules.yml").read_text())
    doc["groups"][0]["rules"][0]["expr"] += " * 2"
    (folder / "ddpmon-rules.yml").write_text(yaml.safe_dump(doc))


def _change_metric(tmp_path, monkeypatch):
    extra = metrics.Metric("ddpmon_docs_probe_total", metrics.MetricType.COUNTER,
                           "A metric only this test declares.", metrics.Layer.NUMERICS)
    original = metrics.by_layer
    monkeypatch.setattr(
        catalogues.metrics, "by_layer",
        lambda layer: [*original(layer), *([extra] if layer is metrics.Layer.NUMERICS else [])],
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class _ConfigWithAnOption:
    enabled: bool = True
    """Master switch."""
    new_option: int = 3
    """An option only this test declares."""


def _change_config(tmp_path, monkeypatch):
    monkeypatch.setattr(catalogues.config, "Config", _ConfigWithAnOption)


def _change_event(tmp_path, monkeypatch):
    kinds = (*event_kinds.EVENT_KINDS, event_kinds.EventKind("docs_probe", "Test only."))
    monkeypatch.setattr(catalogues.event_kinds, "EVENT_KINDS", kinds)


def _change_file(tmp_path, monkeypatch):
    entry = rundir_catalogue.RunDirFile("probe.txt", "", "never", "nothing", "nobody")
    monkeypatch.setattr(catalogues, "FILES", (*rundir_catalogue.FILES, entry))


def _change_history_column(tmp_path, monkeypatch):
    docs = dict(history_schema.COLUMN_DOCS, step="the step, described differently")
    monkeypatch.setattr(catalogues.history_schema, "COLUMN_DOCS", docs)


def _change_cli(tmp_path, monkeypatch):
    import ddpmon.cli

    original = ddpmon.cli.build_parser

    def with_a_flag() -> argparse.ArgumentParser:
        parser = original()
        parser.add_argument("--docs-probe", help="a flag only this test adds")
        return parser

    monkeypatch.setattr(ddpmon.cli, "build_parser", with_a_flag)


def _change_readme(tmp_path, monkeypatch):
    shutil.copytree(ROOT / shipped.PROMETHEUS_DIR, tmp_path / shipped.PROMETHEUS_DIR)
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text() + "\nOne more line.\n")
    monkeypatch.setattr(shipped, "checkout_root", lambda: tmp_path)


@pytest.mark.parametrize(
    ("change", "page"),
    [
        (_change_alert, "docs/reference/alerts.md"),
        (_change_runbook, "docs/reference/alerts.md"),
        (_change_recording_rule, "docs/reference/recording-rules.md"),
        (_change_metric, "docs/reference/metrics.md"),
        (_change_config, "docs/reference/config.md"),
        (_change_event, "docs/reference/events.md"),
        (_change_file, "docs/reference/files.md"),
        (_change_history_column, "docs/reference/files.md"),
        (_change_cli, "docs/reference/cli.md"),
        (_change_readme, "docs/index.md"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.__name__.removeprefix("_change_"),
)
def test_a_changed_source_makes_its_page_stale(change, page, tmp_path, monkeypatch):
    assert stale_pages() == set()
    change(tmp_path, monkeypatch)
    assert stale_pages() == {page}


# -- catalogues the pages are generated from cover the code ------------------------------------
def _emitted_kinds() -> dict[str, set[str]]:
    """kind -> literal keyword fields of every ``emit("<kind>", ...)`` call in ``ddpmon/``."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "ddpmon").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {  # module-level NAME = "text", for emit(GAP_KIND, ...)
            t.id: n.value.value
            for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)
            for t in n.targets if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("emit", "_emit"):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                kinds = [first.value]
            elif isinstance(first, ast.Name) and first.id in constants:
                kinds = [constants[first.id]]
            elif isinstance(first, ast.JoinedStr):  # f"checkpoint_{kind}": every declared match
                prefix = "".join(
                    v.value for v in first.values if isinstance(v, ast.Constant)
                )
                kinds = [k.name for k in event_kinds.EVENT_KINDS if k.name.startswith(prefix)]
                assert kinds, f"{path}:{node.lineno}: no declared kind matches {prefix!r}*"
            else:
                continue  # a forwarding wrapper: emit(kind, ...)
            fields = {kw.arg for kw in node.keywords if kw.arg}
            for kind in kinds:
                found.setdefault(kind, set()).update(fields)
    return found


def test_every_emitted_event_kind_and_field_is_declared():
    emitted = _emitted_kinds()
    assert {"start", "nonfinite", "exit", "write_gap"} <= set(emitted)
    for kind, fields in emitted.items():
        declared = event_kinds.by_name(kind)
        assert declared is not None, f"event kind {kind!r} is written but not declared"
        undeclared = fields - set(declared.fields) - set(event_kinds.COMMON_FIELDS)
        assert not undeclared, f"{kind}: fields written but not declared: {sorted(undeclared)}"


def test_every_run_dir_name_is_described_once():
    sources = [f.source for f in rundir_catalogue.FILES if f.source]
    assert len(sources) == len(set(sources))
    assert set(sources) == rundir_catalogue.declared_names()


def test_every_history_column_is_described():
    assert set(history_schema.COLUMN_DOCS) == set(history_schema.ROW_FIELDS)


def test_the_alerts_table_lists_every_alert_with_its_severity_and_for():
    """docs/alerts.md says in plain words when each alert fires; it is written by hand, so the
    names, severities and ``for:`` it shows are checked against the shipped rule file."""
    table = alerts_table((ROOT / "docs" / "alerts.md").read_text(encoding="utf-8"))
    shipped_rules = {
        r["alert"]: (r["labels"]["severity"], r.get("for", "0m"))
        for g in rules._groups(rules.ALERTS) for r in g["rules"]
    }
    assert table == shipped_rules
