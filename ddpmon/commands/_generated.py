"""Shared ``--write`` / ``--check`` / ``--config`` behaviour of the commands that own generated
files (``ddpmon rules``, ``ddpmon dashboards``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser, *, dir_help: str) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="(re)write the generated files")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 with a diff if the files are out of date"
    )
    p.add_argument("--dir", default=None, metavar="DIR", help=dir_help)
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="YAML file overriding MixinConfig fields (job_selector, stall_seconds, ...)",
    )


def load(args: argparse.Namespace) -> Any:
    """The MixinConfig of ``--config`` (default config without it); exits 2 on a bad file."""
    # loaded when the command runs: a light CLI start
    from ddpmon.mixin.config import MixinConfig, load_config

    if not args.config:
        return MixinConfig()
    try:
        return load_config(args.config)
    except ValueError as exc:
        print(f"ddpmon {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def target_dir(args: argparse.Namespace, *, checkout_default: Path | None) -> Path | None:
    """Where to write: ``--dir``, else the checkout's copy; None (with a message) outside a
    checkout, where the packaged copies must not be overwritten."""
    if args.dir:
        return Path(args.dir)
    if checkout_default is None:
        print(
            f"ddpmon {args.command}: not in a ddpmon checkout; give --dir DIR to write the files",
            file=sys.stderr,
        )
    return checkout_default


def write_or_check(
    *,
    write: bool,
    root: str | Path | None,
    write_fn: Callable[[str | Path], list[Path]],
    check_fn: Callable[[str | Path | None], list[str]],
    what: str,
    fix: str,
) -> int:
    """Write the files (print each path), or print diffs and return 1 when they are stale."""
    if write:
        if root is None:
            return 2
        for path in write_fn(root):
            print(f"wrote {path}")
        return 0
    diffs = check_fn(root)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print(f"{what} out of date: run `{fix}`")
        return 1
    print(f"{what} up to date")
    return 0
