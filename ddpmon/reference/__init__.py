"""Reference pages of the docs site, generated from the code: ``docs/reference/*.md``.

Why generated: metric names, alert rules, CLI flags, attach options, event kinds and run-dir
files are contracts. Retyped by hand they drift from the code; generated, a test
(``python -m ddpmon.reference --check``) fails the moment the code changes and the docs do not.
Write them with ``make reference`` (``python -m ddpmon.reference --write``).
"""

from __future__ import annotations

from pathlib import Path

from ..mixin.files import diff_files, write_files

REFERENCE_DIR = "docs/reference"


def generate() -> dict[str, str]:
    """``{path relative to the repository root: Markdown}`` for every reference page."""
    from . import catalogues, cli, rules

    pages = {
        "metrics.md": catalogues.metrics_page(),
        "config.md": catalogues.config_page(),
        "events.md": catalogues.events_page(),
        "files.md": catalogues.files_page(),
        "alerts.md": rules.alerts_page(),
        "recording-rules.md": rules.recording_rules_page(),
        "cli.md": cli.cli_page(),
    }
    return {f"{REFERENCE_DIR}/{name}": text for name, text in pages.items()}


def write(root: str | Path) -> list[Path]:
    return write_files(root, generate())


def check(root: str | Path) -> list[str]:
    """Unified diffs of the committed pages that differ from what the code generates."""
    return diff_files(root, generate())
