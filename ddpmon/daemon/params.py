"""The arguments an entry point accepts: declared names and types, checked before a job runs.

A job request's ``args`` are parsed against its entry point's declaration, never passed on as
given. An option the entry point does not declare, a value of the wrong type, a positional
argument beyond the declared ones and a bare ``--`` (which torchrun would swallow) are each a
precise refusal naming ``args[i]``. A ``path`` value is confined to the job's own directory
under the daemon's state dir: relative, no ``..``, and rewritten to that absolute path, so a
submitter can neither read nor plant files elsewhere. Declared in the daemon config::

    entrypoints:
      train:
        script: /opt/train/main.py
        params:                      # --name: type, or {type: ..., choices: [...], repeat: true}
          --epochs: int
          --lr: float
          --size: {type: choice, choices: [small, large]}
          --resume: flag
          --out: path
        positional: [float]          # optional positional values, in order
        # positional: [{type: str, leading_dash: true}]   # opt in to values such as "-x"

A positional value that starts with ``-`` is refused: the script would parse it as an option it
never declared (``-o/some/path``). A declaration that really takes such values (a negative
number, a file named ``-``) opts in with ``leading_dash: true`` on that positional.

Types: ``int``, ``float`` (finite), ``str``, ``flag`` (no value), ``choice``, ``path``. An entry
point that declares nothing takes no arguments. The demo module's own declaration is
``DEMO_PARAMS``: no ``--port``, ``--run-dir``, ``--sd-dir`` or ``--daemon-url``, which the daemon
sets itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..demo import AUTOCAST_DTYPES, OPTIONAL_STATES

TYPES = ("int", "float", "str", "flag", "choice", "path")
_INT = re.compile(r"^[+-]?\d{1,18}$")
_NAME = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


class ParamError(ValueError):
    """A request argument or a declaration that does not fit; the message names it."""


@dataclass(frozen=True, slots=True)
class Param:
    """One declared argument: an option (``--name``) or a positional value."""

    name: str
    type: str
    choices: tuple[str, ...] = ()
    repeat: bool = False
    leading_dash: bool = False
    """A positional value may start with ``-`` (off: such a value is refused as an option)."""

    def check(self, value: str, where: str, job_dir: Path | None) -> str:
        """The value as the job gets it (a path made absolute inside ``job_dir``)."""
        kind = self.type
        if kind == "int" and not _INT.match(value):
            raise ParamError(f"{where}: {self.name} expects an integer, got {value!r}")
        if kind == "float":
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                raise ParamError(f"{where}: {self.name} expects a finite number, got {value!r}")
        if kind == "choice" and value not in self.choices:
            raise ParamError(
                f"{where}: {self.name} expects one of {', '.join(self.choices)}; got {value!r}"
            )
        if kind == "path":
            return confine(value, job_dir, f"{where}: {self.name}")
        return value


DEMO_PARAMS: dict[str, Param] = {
    p.name: p
    for p in (
        Param("--steps", "int"),
        Param("--batch-size", "int"),
        Param("--lr", "float"),
        Param("--step-delay", "float"),
        Param("--inject", "str", repeat=True),
        Param("--no-amp", "flag"),
        Param("--autocast", "choice", AUTOCAST_DTYPES),
        Param("--on-nonfinite", "choice", ("record", "skip", "raise")),
        Param("--pg-timeout", "float"),
        Param("--hold", "float"),
        Param("--linger", "float"),
        Param("--seed", "int"),
        Param("--checkpoint-every", "int"),
        Param("--checkpoint-dir", "path"),
        Param("--resume", "flag"),
        Param("--resume-without", "choice", OPTIONAL_STATES, repeat=True),
    )
}
"""What ``ddpmon.demo.train`` accepts through the gateway (docs/daemon.md)."""


def confine(value: str, job_dir: Path | None, where: str) -> str:
    """``value`` as a path inside ``job_dir``: relative, without ``..``; refused otherwise."""
    if not value or value.startswith(("/", "~")) or "\\" in value:
        raise ParamError(f"{where}: {value!r} must be a relative path inside the job directory")
    parts = Path(value).parts
    if ".." in parts:
        raise ParamError(f"{where}: {value!r} leaves the job directory ('..')")
    if job_dir is None:
        return value
    return str(Path(job_dir, *parts))


def inside(path: str | Path, job_dir: Path) -> bool:
    """Does ``path`` stay in ``job_dir`` once symlinks are resolved (checked at launch, when the
    directory exists: a link planted in it must not lead out)?"""
    root = os.path.realpath(job_dir)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def parse_declaration(
    params: Mapping[str, Any] | None, positional: Sequence[Any] | None, where: str
) -> tuple[dict[str, Param], tuple[Param, ...]]:
    """The entry point's ``params``/``positional`` config, checked (``ParamError`` names the
    key)."""
    options: dict[str, Param] = {}
    if params is not None and not isinstance(params, Mapping):
        raise ParamError(f"{where}.params: expected a mapping of --name -> type")
    for name, spec in (params or {}).items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ParamError(f"{where}.params: {name!r} is not an option name like --steps")
        options[name] = _param(name, spec, f"{where}.params.{name}")
    if positional is not None and not isinstance(positional, (list, tuple)):
        raise ParamError(f"{where}.positional: expected a list of types")
    values = tuple(
        _param(f"positional {i}", spec, f"{where}.positional[{i}]")
        for i, spec in enumerate(positional or ())
    )
    if any(p.type == "flag" or p.repeat for p in values):
        raise ParamError(f"{where}.positional: a positional value cannot be a flag or repeat")
    if any(p.leading_dash for p in options.values()):
        raise ParamError(f"{where}.params: leading_dash applies to positional values only")
    return options, values


def _param(name: str, spec: Any, where: str) -> Param:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping):
        raise ParamError(f"{where}: expected a type name or {{type: ...}}")
    extra = set(spec) - {"type", "choices", "repeat", "leading_dash"}
    if extra:
        raise ParamError(f"{where}: unknown key(s) {sorted(extra)}")
    kind = spec.get("type")
    if kind not in TYPES:
        raise ParamError(f"{where}: type {kind!r}: expected one of {', '.join(TYPES)}")
    choices = spec.get("choices", ())
    if kind == "choice" and (
        not isinstance(choices, (list, tuple)) or not choices
        or not all(isinstance(c, str) for c in choices)
    ):
        raise ParamError(f"{where}: a choice needs a non-empty list of strings 'choices'")
    repeat = spec.get("repeat", False)
    if not isinstance(repeat, bool):
        raise ParamError(f"{where}: repeat: expected true or false")
    dash = spec.get("leading_dash", False)
    if not isinstance(dash, bool):
        raise ParamError(f"{where}: leading_dash: expected true or false")
    return Param(name, kind, tuple(choices), repeat, dash)


def check_args(
    args: Iterable[str],
    options: Mapping[str, Param],
    positional: Sequence[Param],
    job_dir: Path | None,
    entrypoint: str,
) -> list[str]:
    """``args`` parsed against the declaration: the argv the job gets (``--name value`` pairs,
    paths confined to ``job_dir``), or ``ParamError`` naming the first argument that does not
    fit."""
    args = list(args)
    out: list[str] = []
    seen: set[str] = set()
    given = 0
    i = 0
    while i < len(args):
        token, where = args[i], f"args[{i}]"
        if token == "--":
            raise ParamError(f"{where}: a bare '--' is not accepted (torchrun would swallow it)")
        if token.startswith("--"):
            name, eq, inline = token.partition("=")
            param = options.get(name)
            if param is None:
                known = ", ".join(sorted(options)) or "none"
                raise ParamError(
                    f"{where}: {_shown(name)} is not an argument of entrypoint {entrypoint!r} "
                    f"(it accepts: {known})"
                )
            if name in seen and not param.repeat:
                raise ParamError(f"{where}: {name} given twice")
            seen.add(name)
            if param.type == "flag":
                if eq:
                    raise ParamError(f"{where}: {name} is a flag and takes no value")
                out.append(name)
                i += 1
                continue
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 2
            else:
                raise ParamError(f"{where}: {name} needs a value")
            out += [name, param.check(value, where, job_dir)]
            continue
        if given >= len(positional):
            raise ParamError(
                f"{where}: {_shown(token)}: entrypoint {entrypoint!r} takes "
                f"{len(positional)} positional argument(s)"
            )
        if token.startswith("-") and not positional[given].leading_dash:
            raise ParamError(
                f"{where}: {_shown(token)} starts with '-', so the script would read it as an "
                f"option; entrypoint {entrypoint!r} does not declare it (a positional value "
                "that may start with '-' is declared with leading_dash: true)"
            )
        out.append(positional[given].check(token, where, job_dir))
        given += 1
        i += 1
    return out


def _shown(text: str, limit: int = 60) -> str:
    """A request's text in a message: quoted, escaped, cut."""
    shown = repr(text[:limit])
    return shown + ("..." if len(text) > limit else "")
