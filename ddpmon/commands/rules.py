"""``ddpmon rules``: write or check the generated Prometheus rule files.

In a checkout, ``deploy/prometheus/`` holds the committed outputs of ``ddpmon/mixin``; the test
suite runs ``--check`` so a config change that was not regenerated fails loudly. Installed from
a wheel, ``--check`` compares against the copies shipped in the package and ``--write`` needs
``--dir``. ``--config mixin.yaml`` overrides MixinConfig fields (job selector, thresholds...).
"""

from __future__ import annotations

import argparse

from ._generated import add_arguments, load, target_dir, write_or_check


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rules", help="generate (--write) or verify (--check) the Prometheus alert/recording rules"
    )
    add_arguments(p, dir_help="output directory (default: deploy/prometheus of this checkout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpmon.mixin import render, shipped  # loaded when the command runs: a light CLI start

    cfg = load(args)
    checkout = shipped.checkout_root()
    default = checkout / shipped.PROMETHEUS_DIR if checkout else None
    return write_or_check(
        write=args.write,
        root=target_dir(args, checkout_default=default) if args.write else args.dir,
        write_fn=lambda d: render.write(d, cfg),
        check_fn=lambda d: render.check(d, cfg),
        what="rule files are",
        fix="ddpmon rules --write` (or `make rules",
    )
