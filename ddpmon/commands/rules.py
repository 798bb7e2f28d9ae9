"""``ddpmon rules``: write or check the generated Prometheus rule files.

The files in ``deploy/prometheus/`` are outputs of ``ddpmon/mixin``; CI runs ``--check`` (via
the test suite) so a config change that was not regenerated fails loudly.
"""

from __future__ import annotations

import argparse
import sys


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

    directory = args.dir or render.DEFAULT_DIR
    if args.write:
        for path in render.write(directory):
            print(f"wrote {path}")
        return 0
    diffs = render.check(directory)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print("rule files are out of date: run `ddpmon rules --write` (or `make rules`)")
        return 1
    print("rule files are up to date")
    return 0
