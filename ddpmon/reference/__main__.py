"""``python -m ddpmon.reference --write|--check [--root DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import check, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpmon.reference", description=__doc__)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite docs/reference/*.md")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when stale")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = p.parse_args(argv)
    if args.write:
        for path in write(args.root):
            print(path)
        return 0
    diffs = check(args.root)
    if diffs:
        sys.stdout.write("".join(diffs))
        print("docs/reference is stale: run `make reference`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
