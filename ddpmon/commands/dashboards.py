"""``ddpmon dashboards``: write or check the generated Grafana dashboards and Kubernetes manifests.

``dashboards/*.json`` and ``deploy/kubernetes/*.yaml`` are outputs of ``ddpmon/mixin``, written
under ``--dir`` (default: the checkout's root). The test suite runs the check, so a config
change that was not regenerated fails loudly. Needs the ``dashboards`` extra
(grafana-foundation-sdk).
"""

from __future__ import annotations

import argparse

from ._generated import add_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dashboards",
        help="generate (--write) or verify (--check) the Grafana dashboards and k8s manifests",
    )
    add_arguments(
        p, dir_help="root to write dashboards/ and deploy/kubernetes/ under (default: this "
        "checkout)",
    )
    p.add_argument("--root", dest="dir", help=argparse.SUPPRESS)  # the former name of --dir
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import outputs, shipped

    from ._generated import load, target_dir, write_or_check

    cfg = load(args)
    return write_or_check(
        write=args.write,
        root=target_dir(args, checkout_default=shipped.checkout_root()) if args.write else args.dir,
        write_fn=lambda d: outputs.write(d, cfg),
        check_fn=lambda d: outputs.check(d, cfg),
        what="dashboards and manifests are",
        fix="ddpmon dashboards --write",
    )
