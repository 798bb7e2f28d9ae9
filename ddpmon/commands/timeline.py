"""``ddpmon timeline RUN_DIR``: all ranks' events on one clock, and the first failure named.

Exit status: 0 the run was read (whether or not it failed), 2 no run or no events there,
3 a partial run (some ranks of the world size left no files; the view is still printed).
"""

from __future__ import annotations

import argparse
import json
import sys

from ddpmon.rundir.atomic import dumps
from ddpmon.terminal import SafeConsole as Console
from ddpmon.terminal import clean_line, shown


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "timeline",
        help="merge all ranks' events on one clock and name the first failure",
        description="Merge all ranks' event logs, crash files and evidence of a run on rank 0's "
        "clock; state the first failure (rank, step, kind, tensor or signal) and how each "
        "rank ended. RUN_DIR is run_dir/<run_id> (or a run_dir holding exactly one run).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--steps", action="store_true", help="also list per-step events")
    p.add_argument("--no-slurm", action="store_true",
                   help="do not ask Slurm (sacct, scontrol) how the run's job ended")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.timeline import RunDirError, build_timeline

    try:
        tl = build_timeline(args.run_dir)
    except RunDirError as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "warnings": exc.damage.lines(),
                              "damaged": exc.damage.to_json()}))
        else:
            print(f"ddpmon timeline: {clean_line(exc)}", file=sys.stderr)
        return 2
    from ._damage import print_damage  # loaded when the command runs: a light CLI start

    print_damage("timeline", tl.damage.lines())
    slurm = None
    if not args.no_slurm:
        # loaded when the command runs: a light CLI start
        from ddpmon.forensics import slurm_outcome

        job = slurm_outcome.job_id_of(tl.run_path)
        slurm = slurm_outcome.query(job) if job else None
    from ddpmon.forensics.goodput import of_timeline  # at run: a light CLI start

    goodput = of_timeline(tl)
    if args.json:
        print(dumps({**tl.to_json(), "slurm": slurm,
                     "goodput": goodput.to_json() if goodput else None},
                    indent=1, sort_keys=False))
    else:
        _render(tl, show_steps=args.steps, slurm=slurm, goodput=goodput)
    return 3 if tl.missing_ranks else 0


def _render(tl, show_steps: bool, slurm: dict | None = None, goodput=None) -> None:
    """The timeline as text; the verdict is its last line (what a reader and a script look for)."""
    from rich.table import Table  # rich loads only when used: a light CLI start

    # loaded when the command runs: a light CLI start
    from ddpmon.forensics.timeline import describe

    console = Console(highlight=False)
    offsets = ", ".join(
        f"r{r} {v['clock_offset_seconds']:+.6f}s" for r, v in sorted(tl.ranks.items())
    )
    console.print(f"[bold]Run[/bold] {shown(tl.run_path)}  ranks seen: {len(tl.ranks)}"
                  + (f" of {tl.world_size}" if tl.world_size else ""))
    console.print(f"clock offsets to rank 0: {offsets}")
    damaged = set(tl.damage.lines())  # already on stderr
    for w in tl.warnings:
        if w not in damaged:
            console.print(f"[yellow]warning:[/yellow] {shown(w)}")
    ff = tl.first_failure
    if ff:
        what = ff.get("param") or ff.get("signal") or ff.get("exc_type") or ff.get("detail") or ""
        console.print(
            f"[bold red]First failure:[/bold red] rank {shown(ff['rank'])}, "
            f"step {shown(ff['step'])}"
            + (f" ({shown(ff['phase'])})" if ff.get("phase") else "")
            + f", {shown(ff['kind'])}" + (f" ({shown(what)})" if what else "")
            + f" at +{ff['t_rel']:.3f}s " + shown(f"[{ff['class']}]")
        )
        if ff.get("flight_recorder"):
            enq = shown(", ".join(f"r{r} {n}" for r, n in sorted(ff["flight_recorder"].items())))
            console.print(f"  collectives enqueued (flight recorder): {enq}; the rank behind "
                          "stopped issuing them, the others wait for it")
    else:
        console.print("[green]No failure recorded.[/green]")
    _render_recovery(console, tl.recovery)

    table = Table(show_lines=False, header_style="bold")
    for col in ("t (s)", "attempt", "rank", "step", "kind", "details"):
        # details fold where they cannot wrap: a long parameter name is what the reader came for
        details = col == "details"
        table.add_column(col, no_wrap=not details, overflow="fold" if details else "ellipsis")
    first_event = _match(tl, ff)
    rows = [e for e in tl.events if show_steps or e.get("kind") != "step"]
    hidden = len(tl.events) - len(rows)
    for e in _shown_rows(rows, first_event, MAX_TABLE_ROWS):
        if isinstance(e, int):
            table.add_row("…", "", "", "", "", f"{e} events not shown (--json lists them all)")
            continue
        style = "red" if e is first_event else None
        table.add_row(f"{e['t_rel']:.3f}", shown(e.get("attempt", 0)), shown(e.get("rank")),
                      shown(e.get("step")), shown(e.get("kind")), shown(describe(e)), style=style)
    console.print(table)
    if hidden:
        console.print(f"({hidden} step events hidden; --steps shows them)")
    console.print("[bold]How each rank ended[/bold]")
    for rank, info in sorted(tl.ranks.items()):
        last = info.get("last_event") or {}
        ev = f"; evidence: {shown(', '.join(info['evidence']))}" if info.get("evidence") else ""
        console.print(
            f"  rank {shown(rank)}: {shown(info['ended'])}; last event {shown(last.get('kind'))} "
            f"at step {shown(last.get('step'))} (+{last.get('t_rel', 0):.3f}s){ev}"
        )
    if slurm:
        # loaded when the command runs: a light CLI start
        from ddpmon.forensics.slurm_outcome import line

        console.print(f"[bold]Slurm:[/bold] {shown(line(slurm))}")
    if goodput is not None:
        from ddpmon.forensics.goodput.text import render  # at run: a light CLI start

        render(goodput)
    if tl.stragglers:
        # loaded when the command runs: a light CLI start
        from ddpmon.forensics.stragglers import describe as straggler

        for s in tl.stragglers:
            console.print(f"[bold]Straggler:[/bold] {shown(straggler(s))}")
    if tl.verdict:
        console.print(f"[bold]Verdict:[/bold] {shown(tl.verdict['line'])}")


def _render_recovery(console, rec: dict) -> None:
    """Attempts on the one clock, the last good checkpoint and what a restart from it costs."""

    attempts = rec.get("attempts") or []
    if len(attempts) > 1 or any(a.get("resumed_from") for a in attempts):
        console.print(f"[bold]Attempts[/bold] ({len(attempts)}, one clock):")
        for a in _shown_rows(attempts, None, MAX_ATTEMPT_LINES):
            if isinstance(a, int):
                console.print(f"  … {a} attempts not shown (--json lists them all)")
                continue
            resumed = a.get("resumed_from")
            how = "fresh start"
            if resumed:
                at = "an unstated step" if resumed["step"] is None else f"step {resumed['step']}"
                how = f"resumed from {shown(at)} ({shown(resumed.get('path'))})"
                if resumed.get("not_restored"):
                    how += "; NOT restored: " + shown(", ".join(resumed["not_restored"]))
                if resumed.get("not_stated"):
                    how += "; restore not stated for: " + shown(", ".join(resumed["not_stated"]))
            console.print(
                f"  attempt {a['attempt']}: +{a['t_rel_start']:.3f}s to +{a['t_rel_end']:.3f}s, "
                f"{how}, last step {shown(a.get('last_step'))}"
            )
    if "last_good_checkpoint" not in rec:
        return
    good, lost = rec.get("last_good_checkpoint"), rec.get("steps_lost")
    if good:
        console.print(
            f"[bold]Last good checkpoint[/bold] before the first failure: step "
            f"{shown(good['step'])} ({shown(good.get('path'))}, attempt {shown(good['attempt'])});"
            " a restart from it loses "
            f"{lost if lost is not None else '?'} step(s)"
        )
    else:
        console.print(
            "[bold]No checkpoint[/bold] before the first failure: a restart loses "
            f"{lost if lost is not None else 'every'} step(s)"
        )
    restarted = rec.get("restarted")
    if restarted:
        resumed = restarted.get("resumed_from")
        where = f"resumed from step {resumed['step']}" if resumed else "started from scratch"
        console.print(f"  restarted as attempt {shown(restarted['attempt'])}: {shown(where)}")
        if resumed and resumed.get("missing"):
            console.print(
                "  [yellow]state not restored:[/yellow] " + shown(", ".join(resumed["missing"]))
                + " (the resumed run can differ from an uninterrupted one)"
            )


MAX_TABLE_ROWS = 400
"""Events the table shows (the first and last halves, and the first failure): a terminal table
of more is not read, and would take rich seconds; ``--json`` has every event."""
MAX_ATTEMPT_LINES = 40


def _shown_rows(rows: list, keep, limit: int) -> list:
    """``rows`` when at most ``limit``, else its first and last halves with, in place of each
    gap, the number of rows left out there (``keep``, the first failure, stays in its place)."""
    if len(rows) <= limit:
        return rows
    head, tail = limit // 2, len(rows) - (limit - limit // 2)
    at = next((i for i, r in enumerate(rows) if r is keep), None) if keep is not None else None
    if at is None or not head <= at < tail:
        return [*rows[:head], tail - head, *rows[tail:]]
    return [*rows[:head], *([at - head] if at > head else []), rows[at],
            *([tail - at - 1] if tail > at + 1 else []), *rows[tail:]]


def _match(tl, ff):
    if not ff:
        return None
    for e in tl.events:
        if e.get("rank") == ff["rank"] and e.get("t") == ff["t"] and e.get("kind") == ff["kind"]:
            return e
    return None
