"""``ddpmon compare RUN_A RUN_B``: step-by-step numerics of two runs, first divergence named.

Exit status: 0 comparable and no divergence, 1 diverged, 2 a run could not be read,
3 the runs are not comparable (different global batch, seed, precision or model; the
comparison is still printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from rich import box

from ddpmon.rundir.atomic import dumps
from ddpmon.terminal import SafeConsole as Console
from ddpmon.terminal import shown as escape  # markup-escaped and control codes spelled out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="align two runs by optimizer step and name the first divergent step and group",
        description="Compare two runs' numerics histories step by step (e.g. a 1-rank baseline "
        "and a multi-rank run with the same global batch and seed). The tolerance of each "
        "series comes from the runs' own reduction-order noise over their first steps.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="run_dir/<run_id> of the baseline")
    p.add_argument("run_b", metavar="RUN_B", help="run_dir/<run_id> of the run to check")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ('pyarrow',) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ddpmon compare: needs {', '.join(missing)}: pip install pyarrow",
              file=sys.stderr)
        return 2
    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.compare import CompareError, compare_runs, run_damage_lines

    try:
        result = compare_runs(args.run_a, args.run_b)
    except CompareError as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "warnings": run_damage_lines(exc.damaged),
                              "damaged": exc.damaged}))
        else:
            print(f"ddpmon compare: {exc}", file=sys.stderr)
        return 2
    if args.json:
        from ._damage import print_damage  # loaded when the command runs: a light CLI start

        print_damage("compare", result.damage_lines())
        print(dumps(result.to_json(), indent=1, sort_keys=False))
    else:
        render(result)
    if not result.comparable:
        return 3
    return 1 if result.diverged else 0


def render(c) -> None:
    from rich.table import Table  # rich loads only when used: a light CLI start

    from ._damage import print_damage  # loaded when the command runs: a light CLI start

    console = Console(highlight=False)
    fa, fb = c.facts["a"], c.facts["b"]
    console.print(f"[bold]A[/bold] {escape(str(c.run_a))}  ({escape(_facts(fa))})")
    console.print(f"[bold]B[/bold] {escape(str(c.run_b))}  ({escape(_facts(fb))})")
    console.print(escape(c.basis_line()))
    damaged = set(c.damage_lines())
    for w in c.warnings:
        if w in damaged:
            print_damage("compare", [w])
        else:
            console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    if not c.comparable:
        console.print("[bold red]Not comparable:[/bold red] " + escape("; ".join(c.reasons)))
    if c.diverged:
        where = f" in group [bold]{escape(c.first_group)}[/bold]" if c.first_group else ""
        console.print(
            f"[bold red]First divergence:[/bold red] step {c.first_step}{where} "
            f"(series over tolerance there: {escape(', '.join(c.first_series))})"
        )
    else:
        console.print(f"[green]No divergence[/green] over {c.common_steps} common steps.")
    # Fits 80 columns (a CI log, a narrow terminal): no box, compact numbers; a cell that does
    # not fit folds onto a second line instead of being cut to an ellipsis.
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  padding=(0, 1), collapse_padding=True)
    for col in ("series", "noise", "tol", "max\nbefore", "first\nstep", "A", "B", "diff"):
        table.add_column(col, justify="left" if col == "series" else "right",
                         overflow="fold", no_wrap=col != "series")
    for s in c.series:
        style = "red" if s.first_step is not None and s.first_step == c.first_step else None
        table.add_row(
            escape(s.name),
            _e(s.noise),
            _e(s.tolerance),
            _e(s.max_rel_before),
            "-" if s.first_step is None else str(s.first_step),
            _g(s.value_a),
            _g(s.value_b),
            _e(s.rel_diff),
            style=style,
        )
    console.print(table)
    console.print(
        "diff: |A - B| / max(|A|, |B|); tol: 100 x the largest diff over the first 8 "
        "common steps (reduction-order noise), within [1e-3, 5e-2]"
    )


def _facts(f: dict) -> str:
    keys = ("world_size", "global_batch", "micro_batch", "accumulation", "seed", "precision")
    return ", ".join(f"{k}={f.get(k)}" for k in keys if f.get(k) is not None) or "no facts"


def _g(v) -> str:
    return "-" if v is None else f"{v:.5g}"


def _e(v) -> str:
    """A relative difference in 7 characters (``1.2e-03``); ``inf`` stays ``inf``."""
    if v is None:
        return "-"
    return f"{v:.1e}" if isinstance(v, float) and v == v and abs(v) != float("inf") else str(v)
