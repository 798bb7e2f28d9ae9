"""``ddpmon manifest RUN_DIR [--check]``: show a run's manifest, or list what it lacks.

Exit status: 0 shown / complete, 1 ``--check`` found missing items (listed one per line),
2 no run or no manifest there, or the manifest is damaged (named on stderr; without ``--check``
its text is still shown as it is).
"""

from __future__ import annotations

import argparse
import sys

from ddpmon.rundir.damage import ReadWarnings
from ddpmon.rundir.layout import RunDir
from ddpmon.rundir.safe_read import MAX_DOCUMENT_BYTES, open_regular
from ddpmon.terminal import clean, clean_line


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
    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.run_facts import load_manifest
    from ddpmon.forensics.timeline import RunDirError, resolve_run_path
    from ddpmon.recorder.manifest import CHECKLIST, check_manifest

    from ._damage import print_damage  # loaded when the command runs: a light CLI start

    try:
        run_path = resolve_run_path(args.run_dir)
    except RunDirError as exc:
        print(f"ddpmon manifest: {clean_line(exc)}", file=sys.stderr)
        return 2
    path = RunDir(run_path).manifest()
    if not path.exists():
        print(f"ddpmon manifest: {clean_line(path)} does not exist (rank 0 writes it at attach)",
              file=sys.stderr)
        return 2
    damage = ReadWarnings(run_path)
    data = load_manifest(run_path, damage, kept="shown as it is" if not args.check
                         else "no checklist item can be confirmed")
    print_damage("manifest", damage.lines())
    if not args.check:
        try:  # shown as it is, damaged or not: what is readable is still worth reading
            with open_regular(path) as fh:  # a FIFO or device in its place never blocks
                text = fh.read(MAX_DOCUMENT_BYTES).decode("utf-8", errors="replace")
            print(clean(text.rstrip()))
        except OSError:
            pass
        return 0 if data is not None else 2
    if data is None:
        print(f"{clean_line(path)}: unreadable, so no checklist item can be confirmed "
              f"({len(CHECKLIST)} of {len(CHECKLIST)} unconfirmed)")
        return 2
    missing = check_manifest(run_path)
    na = data.get("not_applicable")
    na = na if isinstance(na, dict) else {}
    if missing:
        print(f"{clean_line(path)}: {len(missing)} of {len(CHECKLIST)} checklist items missing:")
        for item in missing:
            print(f"  missing: {clean_line(item)}")
    else:
        print(f"{clean_line(path)}: all {len(CHECKLIST)} checklist items recorded")
    for item, why in sorted(na.items()):
        print(f"  n/a: {clean_line(item)} ({clean_line(why)})")
    return 1 if missing else 0
