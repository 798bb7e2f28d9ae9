"""``ddpmon report RUN_DIR -o report.html``: one self-contained HTML page of a run.

Exit status: 0 written, 2 the run could not be read or the output not written.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ddpmon.rundir.atomic import write_text_atomic
from ddpmon.rundir.damage import ReadWarnings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write one self-contained HTML page: manifest, first failure, timeline, plots",
        description="Write a post-mortem page of a run: the manifest summary, the first failure "
        "and the timeline, and plots of loss, norms (global, local per rank, group heatmap), "
        "loss scale and skipped steps, step time and data wait, memory and all-reduce p50/p99. "
        "One file, no network requests, readable from 2 to 1024 ranks.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run_dir/<run_id>")
    p.add_argument("-o", "--output", default="report.html", help="HTML file (default report.html)")
    p.add_argument("--compare", metavar="RUN_B", default=None,
                   help="overlay this run (the baseline) and add the compare table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ('pyarrow', 'matplotlib') if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ddpmon report: needs {', '.join(missing)}: pip install 'ddpmon[report]'",
              file=sys.stderr)
        return 2
    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.report import ReportError, build_report

    from ._damage import print_damage  # loaded when the command runs: a light CLI start

    damage = ReadWarnings()
    try:
        report = build_report(args.run_dir, args.compare, damage)
    except ReportError as exc:
        print(f"ddpmon report: {exc}", file=sys.stderr)
        return 2
    finally:
        print_damage("report", damage.lines())
    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.report import rests_on_line

    page = report.html
    try:
        write_text_atomic(args.output, page)
    except OSError as exc:
        print(f"ddpmon report: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(page.encode()) / 1024:.0f} KiB)")
    print(rests_on_line(report.basis) + f" (ranks {report.basis['ranks']})")
    return 0

