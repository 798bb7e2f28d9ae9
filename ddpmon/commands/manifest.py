"""``ddpmon manifest RUN_DIR [--check]``: show a run's manifest, or list what it lacks.

Exit status: 0 shown / complete, 1 ``--check`` found missing items (listed one per line),
2 no run or no manifest there.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "manifest",
        help="show a run's manifest, or --check it against the reproducibility checklist",
        description="Print run_dir/<run_id>/manifest.json (versions, topology, launch command, "
        "redacted environment, seeds, batch shapes, precision, data version). With --check, "
        "list the checklist items that are missing and exit 1 if there are any.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--check", action="store_true", help="list missing items; exit 1 if any")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpmon.forensics.manifest import CHECKLIST, check_manifest
    from ddpmon.forensics.timeline import RunDirError, resolve_run_path
    from ddpmon.rundir import RunDir

    try:
        run_path = resolve_run_path(args.run_dir)
    except RunDirError as exc:
        print(f"ddpmon manifest: {exc}", file=sys.stderr)
        return 2
    path = RunDir(run_path).manifest()
    if not path.exists():
        print(f"ddpmon manifest: {path} does not exist (rank 0 writes it at attach)",
              file=sys.stderr)
        return 2
    if not args.check:
        print(path.read_text().rstrip())
        return 0
    missing = check_manifest(run_path)
    data = json.loads(path.read_text())
    na = data.get("not_applicable") or {}
    if missing:
        print(f"{path}: {len(missing)} of {len(CHECKLIST)} checklist items missing:")
        for item in missing:
            print(f"  missing: {item}")
    else:
        print(f"{path}: all {len(CHECKLIST)} checklist items recorded")
    for item, why in sorted(na.items()):
        print(f"  n/a: {item} ({why})")
    return 1 if missing else 0
