"""What a default ``pip install ddpmon`` lacks, and an environment that makes it so (see
``sitecustomize.py`` beside this file)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def _dist(requirement: str) -> str:
    name = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def extras_only_modules() -> list[str]:
    """Top-level import names of every distribution that only an extra of pyproject.toml
    installs (core dependencies are left alone), as far as this venv has them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_dist(r) for r in project["dependencies"]}
    extra = {_dist(r) for reqs in project["optional-dependencies"].values() for r in reqs} - core
    modules = []
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(_dist(d) in extra for d in dists) and not module.startswith("_"):
            modules.append(module)
    return sorted(set(modules))


def default_install_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: a minimal environment) where the extras' modules are absent."""
    env = dict(base if base is not None else {"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    env["DDPMON_TEST_UNINSTALLED"] = ",".join(extras_only_modules())
    return env
