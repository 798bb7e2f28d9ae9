"""``ddpmon dashboards``: write or check the generated Grafana dashboards and Kubernetes manifests.

``dashboards/*.json`` and ``deploy/kubernetes/*.yaml`` are outputs of ``ddpmon/mixin``; the test
suite runs the check, so a config change that was not regenerated fails loudly.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dashboards",
        help="generate (--write) or verify (--check) the Grafana dashboards and k8s manifests",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="(re)write the generated files")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 with a diff if the files are out of date"
    )
    p.add_argument(
        "--root", default=None, help="repository root to write into (default: this checkout)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import outputs

    from ._generated import write_or_check

    return write_or_check(
        write=args.write,
        root=args.root or outputs.REPO_ROOT,
        write_fn=outputs.write,
        check_fn=outputs.check,
        what="dashboards and manifests are",
        fix="ddpmon dashboards --write",
    )
