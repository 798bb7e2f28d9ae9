"""The ``ddpmon`` command. Each subcommand lives in ``ddpmon/commands/<name>.py`` and exposes
``register(subparsers)``; a module's heavy imports stay inside its ``run`` function.

A command is listed if and only if its module exists: ``ORDER`` only fixes the order of the
known ones, and any other public module in ``ddpmon/commands/`` is listed after them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from ddpmon import commands

ORDER = (
    "demo",
    "top",
    "timeline",
    "report",
    "compare",
    "manifest",
    "stack",
    "scaleout",
    "rules",
    "dashboards",
    "daemon",
    "jobs",
)
"""Preferred listing order (that of docs/reference/cli.md); names without a module are
skipped."""

EXTRAS = {
    "grafana_foundation_sdk": "dashboards",
    "fastapi": "daemon",
    "httpx": "daemon",
    "bcrypt": "auth",
}
"""Top-level module of an optional dependency -> the ``ddpmon[extra]`` that installs it."""


def available_commands() -> list[str]:
    """Names of the command modules present in ``ddpmon/commands/``, in listing order."""
    modules = pkgutil.iter_modules(commands.__path__)
    present = {m.name for m in modules if not m.name.startswith("_")}
    return [n for n in ORDER if n in present] + sorted(present - set(ORDER))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpmon", description="Observability for distributed PyTorch training."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in available_commands():
        try:
            module = importlib.import_module(f"ddpmon.commands.{name}")
        except ModuleNotFoundError as exc:
            extra = missing_extra(exc)
            if extra is None:
                raise
            # Listed, and says what to install when run.
            stub = sub.add_parser(name, help=f"(needs ddpmon[{extra}])", add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER)
            stub.set_defaults(func=_raiser(exc))
            continue
        module.register(sub)
    return parser


def _raiser(exc: ModuleNotFoundError):  # noqa: ANN202 - a tiny closure
    def run(_args: argparse.Namespace) -> int:
        raise exc

    return run


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The ``ddpmon[extra]`` that provides the module ``exc`` failed to import, if known."""
    top = (exc.name or "").split(".")[0]
    return EXTRAS.get(top)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(
            f"ddpmon {args.command}: needs the optional extra '{extra}' ({exc.name} is not "
            f"installed): pip install 'ddpmon[{extra}]'",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
