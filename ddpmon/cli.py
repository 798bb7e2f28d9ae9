"""The ``ddpmon`` command. Each subcommand lives in ``ddpmon/commands/<name>.py`` and exposes
``register(subparsers)``; a module's heavy imports stay inside its ``run`` function."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = (
    "demo",
    "top",
    "timeline",
    "report",
    "compare",
    "manifest",
    "stack",
    "rules",
    "dashboards",
    "daemon",
    "jobs",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpmon", description="Observability for distributed PyTorch training."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ddpmon.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ddpmon.commands.{name}":
                continue
            raise
        module.register(sub)
    return parser


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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
