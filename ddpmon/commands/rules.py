"""``ddpmon rules``: write or check the generated Prometheus rule files.

The files in ``deploy/prometheus/`` are outputs of ``ddpmon/mixin``; CI runs ``--check`` (via
the test suite) so a config change that was not regenerated fails loudly.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rules", help="generate (--write) or verify (--check) the Prometheus alert/recording rules"
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="(re)write the rule files")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 with a diff if the files are out of date"
    )
    p.add_argument(
        "--dir", default=None, help="output directory (default: deploy/prometheus of this checkout)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import render

    from ._generated import write_or_check

    return write_or_check(
        write=args.write,
        root=args.dir or render.DEFAULT_DIR,
        write_fn=render.write,
        check_fn=render.check,
        what="rule files are",
        fix="ddpmon rules --write` (or `make rules",
    )
