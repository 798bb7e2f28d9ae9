"""``ddpmon dashboards``: write or check the generated Grafana dashboards and Kubernetes manifests.

``dashboards/*.json`` and ``deploy/kubernetes/*.yaml`` are outputs of ``ddpmon/mixin``, written
under ``--dir`` (default: the checkout's root). The test suite runs the check, so a config
change that was not regenerated fails loudly.

Generating needs the ``dashboards`` extra (grafana-foundation-sdk). Writing the files that ship
does not: ``--write --dir DIR`` without ``--config`` copies the packaged outputs (generated from
the default config, and checked against the generator in CI) when the SDK is absent. A
``--config``, ``--check`` or a rewrite of the checkout itself generates, and says in one line
which extra to install when it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util

from ._generated import add_arguments, load, target_dir, write_or_check


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
    from ddpmon.mixin import shipped  # loaded when the command runs: a light CLI start

    sdk = importlib.util.find_spec("grafana_foundation_sdk") is not None
    if args.write and not args.config and not sdk:
        root = target_dir(args, checkout_default=shipped.checkout_root())
        if root is None:
            return 2
        if root.resolve() != shipped.root().resolve():  # not a rewrite of the shipped files
            # loaded when the command runs: a light CLI start
            from ddpmon.mixin.files import write_files

            for path in write_files(root, shipped.generated_outputs()):
                print(f"wrote {path}")
            return 0
    from ddpmon.mixin import outputs  # loaded when the command runs: a light CLI start

    cfg = load(args)
    return write_or_check(
        write=args.write,
        root=target_dir(args, checkout_default=shipped.checkout_root()) if args.write else args.dir,
        write_fn=lambda d: outputs.write(d, cfg),
        check_fn=lambda d: outputs.check(d, cfg),
        what="dashboards and manifests are",
        fix="ddpmon dashboards --write",
    )
