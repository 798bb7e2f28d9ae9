"""The CLI reference: every ``ddpmon`` command, sub-command and flag, read from the argparse
parser the command itself builds (``ddpmon.cli.build_parser``)."""

from __future__ import annotations

import argparse
import os

from .. import cli
from .markdown import code, header, table


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of each sub-command, in listing order."""
    found = []
    for action in parser._actions:  # argparse has no public walk of its sub-commands
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # aliases share one parser
                    seen.add(id(sub))
                    found.append((name, helps.get(name, ""), sub))
    return found


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.required or d is None or d is argparse.SUPPRESS or d is False or d == []:
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return ""
    return code(d)


def _rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    rows = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if a.option_strings:
            metavar = "" if a.nargs == 0 else " " + (a.metavar or a.dest.upper())
            name = ", ".join(code(s + metavar) for s in a.option_strings)
        else:
            name = code(a.metavar or a.dest)
        choices = f" (one of {', '.join(map(str, a.choices))})" if a.choices else ""
        helptext = (a.help or "") % {"default": a.default} if a.help else ""
        rows.append((name, helptext + choices, _default(a)))
    return rows


def _section(prefix: str, name: str, helptext: str, parser: argparse.ArgumentParser,
             depth: int) -> list[str]:
    title = f"{prefix} {name}".strip()
    out = [f"\n{'#' * depth} `{title}`\n\n"]
    desc = parser.description or helptext
    if desc:
        out.append(" ".join(desc.split()) + "\n\n")
    usage = parser.format_usage().strip().removeprefix("usage: ")
    out.append(f"```text\n{usage}\n```\n\n")
    rows = _rows(parser)
    if rows:
        out.append(table(("argument", "meaning", "default"), rows))
    for sub_name, sub_help, sub in _subparsers(parser):
        out += _section(title, sub_name, sub_help, sub, min(depth + 1, 4))
    return out


def cli_page() -> str:
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # usage lines wrap at the terminal width: make it fixed
    try:
        parser = cli.build_parser()
        parser.prog = "ddpmon"
        out = [
            header(
                "Command line",
                "the argparse parsers of `ddpmon/commands/*.py`",
                """
Every `ddpmon` command with its flags, as `ddpmon COMMAND --help` prints them. Exit status,
unless a command says otherwise: 0 success, 1 a finding (diverged, stale, no rank answered),
2 bad input or nothing to read, 3 a missing optional extra or a partial answer.
""",
            ),
            "\n" + table(("argument", "meaning", "default"), _rows(parser)),
        ]
        for name, helptext, sub in _subparsers(parser):
            out += _section("ddpmon", name, helptext, sub, 2)
        return "".join(out)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
