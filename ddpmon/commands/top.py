"""``ddpmon top``: every rank of a run in one terminal table, columns in the catalogue's layer
order (numerics, data supply, memory, communication), read straight from the ranks' endpoints
through the shared scrape client (http or https, basic auth, ``--scrape-config``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ddpmon.terminal import SafeConsole as Console

from .. import metrics
from ..daemon.hang_naming import RankActivity, name_hang, parse_activity
from ..export.scrape import ScrapeClient, ScrapeConfigError, ScrapeError, flatten, read_sd_dir
from ..rundir.damage import ReadWarnings
from ..terminal import clean_line, shown
from ._top_stragglers import cell as straggler_cell
from ._top_stragglers import straggler_scores


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="live per-rank table scraped from the ranks' /metrics")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--sd-dir", help="file_sd directory the ranks publish into")
    src.add_argument(
        "--targets",
        nargs="+",
        metavar="TARGET",
        help="rank endpoints: host:port, or http(s)://host:port[/path]",
    )
    p.add_argument(
        "--scrape-config",
        metavar="FILE",
        default=None,
        help="Prometheus-style client config: scheme, basic_auth, tls_config",
    )
    p.add_argument("--run", default=None, help="only this run (with --sd-dir)")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period, seconds")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="per-endpoint deadline for the whole scrape, seconds")
    p.add_argument("--once", action="store_true", help="one table (or JSON snapshot), then exit")
    p.add_argument("--json", action="store_true", help="one JSON document per refresh")
    p.set_defaults(func=run)


Cell = Callable[[dict, dict | None, float], str]


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    metric: metrics.Metric | None
    cell: Cell

    @property
    def layer(self) -> metrics.Layer | None:
        return self.metric.layer if self.metric is not None else None


def _value(metric: metrics.Metric, fmt: Callable[[float | None], str]) -> Cell:
    return lambda m, p, dt: fmt(m.get(metric.name))


PINNED = (
    Column("rank", None, lambda m, p, dt: _int(m.get("rank"))),
    Column("step", None, _value(metrics.STEP, lambda v: _int(v))),
)
LAYERED = (
    Column("loss", metrics.LOSS, _value(metrics.LOSS, lambda v: _num(v))),
    Column("grad norm", metrics.GRAD_NORM, _value(metrics.GRAD_NORM, lambda v: _num(v))),
    Column(
        "local norm", metrics.GRAD_LOCAL_NORM, _value(metrics.GRAD_LOCAL_NORM, lambda v: _num(v))
    ),
    Column(
        "NaN origin",
        metrics.GRAD_NONFINITE_ORIGIN_STEPS,
        _value(metrics.GRAD_NONFINITE_ORIGIN_STEPS, lambda v: _int(v)),
    ),
    Column("scale", metrics.AMP_LOSS_SCALE, _value(metrics.AMP_LOSS_SCALE, lambda v: _num(v))),
    Column(
        "skipped", metrics.STEPS_SKIPPED, _value(metrics.STEPS_SKIPPED, lambda v: _int(v))
    ),
    Column("steps/s", metrics.STEPS, lambda m, p, dt: _rate(m, p, dt, metrics.STEPS)),
    Column("step time", metrics.STEP_DURATION, lambda m, p, dt: _mean_ms(m, metrics.STEP_DURATION)),
    Column("data wait", metrics.DATA_WAIT, lambda m, p, dt: _mean_ms(m, metrics.DATA_WAIT)),
    Column(
        "dup batches",
        metrics.DATA_IDENTICAL_BATCHES,
        _value(metrics.DATA_IDENTICAL_BATCHES, lambda v: _int(v)),
    ),
    Column(
        "RSS",
        metrics.PROCESS_RESIDENT_MEMORY,
        _value(metrics.PROCESS_RESIDENT_MEMORY, lambda v: _bytes(v)),
    ),
    Column(
        "CUDA alloc",
        metrics.CUDA_MEMORY_ALLOCATED,
        _value(metrics.CUDA_MEMORY_ALLOCATED, lambda v: _bytes(v)),
    ),
    Column("collectives", metrics.COLLECTIVE_DURATION, lambda m, p, dt: _per_op_ms(m)),
    Column("now", metrics.PHASE_SINCE, lambda m, p, dt: shown(m.get("now", "-"))),
    Column("errors", metrics.AGENT_ERRORS, _value(metrics.AGENT_ERRORS, lambda v: _int(v))),
)
LAYER_ORDER = list(metrics.Layer)
COLUMNS = PINNED + tuple(sorted(LAYERED, key=lambda c: LAYER_ORDER.index(c.layer)))
"""Pinned key columns, then columns grouped in the catalogue's layer order."""


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _int(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.0f}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "-"


def _mean_ms(m: dict, metric: metrics.Metric) -> str:
    count, total = m.get(metric.sample("count")), m.get(metric.sample("sum"))
    return "-" if not count else f"{total / count * 1000:.1f} ms"


OP_SHORT = {
    "all_reduce": "ar",
    "reduce_scatter": "rs",
    "all_gather": "ag",
    "reduce": "red",
    "broadcast": "bc",
    "send": "send",
    "recv": "recv",
}
"""Short op names for the narrow ``collectives`` cell (the ``op`` label's values)."""


def _per_op_ms(m: dict) -> str:
    """Mean time per op since start: ``ar 1.2 rs 3.4 ms`` ('-' before any collective)."""
    fam = metrics.COLLECTIVE_DURATION
    parts = []
    for op in metrics.COLLECTIVE_OPS:
        count = m.get(f'{fam.sample("count")}{{op="{op}"}}')
        total = m.get(f'{fam.sample("sum")}{{op="{op}"}}')
        if count:
            parts.append(f"{OP_SHORT[op]} {total / count * 1000:.1f}")
    return " ".join(parts) + " ms" if parts else "-"


def _rate(m: dict, prev: dict | None, dt: float, metric: metrics.Metric) -> str:
    name = metric.name
    if not prev or dt <= 0 or name not in m or name not in prev:
        return "-"
    return f"{(m[name] - prev[name]) / dt:.2f}"


def _targets(args: argparse.Namespace, damage: ReadWarnings) -> list[str]:
    if args.targets:
        return list(args.targets)
    return [t for t, _ in read_sd_dir(args.sd_dir, args.run, damage)]


INTEGER_SAMPLES = ("rank", metrics.STEP.name)
"""Samples that are counts or indices: integers in ``--json`` (the exposition carries floats)."""


def _json_samples(m: dict | None) -> dict | None:
    """A rank's samples for ``--json``: ``rank`` and ``step`` as integers, not ``0.0``."""
    if m is None:
        return None
    out = dict(m)
    for key in INTEGER_SAMPLES:
        v = out.get(key)
        if isinstance(v, float) and v == v and abs(v) != float("inf") and v == int(v):
            out[key] = int(v)
    return out


Results = dict[str, dict | None]


def _collect(client: ScrapeClient, targets: list[str], timeout: float
             ) -> tuple[Results, dict, dict[str, RankActivity]]:
    """Every target's flattened samples (None when down), each failure's message, and each
    target's activity (phase, collectives, where it is stuck: ``hang_naming``)."""
    errors: dict[str, str] = {}
    activity: dict[str, RankActivity] = {}

    def one(target: str) -> dict | None:
        try:
            text = client.fetch(target, timeout)
            activity[target] = parse_activity(text)
            return flatten(text)
        except (ScrapeError, ScrapeConfigError, ValueError) as exc:
            errors[target] = str(exc)
            return None

    if not targets:
        return {}, errors, activity
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return dict(zip(targets, pool.map(one, targets), strict=True)), errors, activity


def _now(act: RankActivity) -> str:
    """The ``now`` cell: the phase, the collective in flight, ``stuck`` past hang_seconds."""
    parts = [act.phase or "-"]
    parts += [f"{f.get('op')}#{f.get('seq')}@{g}" for g, f in sorted(act.inflight.items())]
    if act.stuck_seconds is not None:
        parts.append(f"stuck {act.stuck_seconds:.0f}s at {act.frame}")
    return " ".join(parts)


def _hang_line(hang: dict) -> str:
    c = hang["collective"]
    held = "; ".join(f"rank {h['rank']} ({h['phase']}{', quiet' if h['quiet'] else ''}"
                     f"{', at ' + h['frame'] if h['frame'] else ''})" for h in hang["holders"])
    held = held or "; ".join(f"rank {h['rank']} in {h['op']} instead ({h['phase']}"
                             f"{', at ' + h['frame'] if h['frame'] else ''})"
                             for h in hang.get("mismatch", ()))
    return (f"hang: ranks {hang['waiting']} wait in {c['op']} #{c['seq']} on group {c['group']} "
            f"for: {held or 'no rank behind it'}" + ("" if hang["pages"] else " (no page)"))


def _table(results: Results, previous: dict, dt: float):
    from rich.table import Table  # rich loads only when used: a light CLI start

    table = Table(title=f"ddpmon top: {len(results)} rank endpoint(s)")
    for col in COLUMNS:
        header = f"{col.header}\n[dim]{col.layer}[/]" if col.layer else col.header
        table.add_column(header, justify="right")
    table.add_column("slowdown\n[dim]vs median rank[/]", justify="right")
    scores = straggler_scores(results, previous)
    rows = []
    for target, m in results.items():
        if m is None:
            rows.append((float("inf"), ["[red]down", *[""] * len(COLUMNS)]))  # named below
            continue
        cells = [col.cell(m, previous.get(target), dt) for col in COLUMNS]
        cells.append(straggler_cell(scores.get(target)))
        rows.append((m.get("rank", float("inf")), cells))
    for _, cells in sorted(rows, key=lambda r: r[0]):
        table.add_row(*cells)
    return table


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        client = ScrapeClient.from_file(args.scrape_config)
        for target in args.targets or ():
            client.target(target)  # a malformed target is a usage error, not a down rank
    except ScrapeConfigError as exc:
        print(f"ddpmon top: {exc}", file=sys.stderr)
        return 2
    previous: dict[str, dict] = {}
    last = time.monotonic()
    if args.sd_dir and not Path(args.sd_dir).is_dir():
        print(f"ddpmon top: --sd-dir {args.sd_dir}: no such directory", file=sys.stderr)
        return 2
    while True:
        damage = ReadWarnings(Path(args.sd_dir) if args.sd_dir else None)
        targets = _targets(args, damage)
        results, errors, activity = _collect(client, targets, args.timeout)
        hang = name_hang(list(activity.values()))
        for target, act in activity.items():
            if results.get(target) is not None:
                results[target]["now"] = _now(act)  # type: ignore[index]
        now = time.monotonic()
        for line in damage.lines():
            print(f"ddpmon top: warning: {clean_line(f'{args.sd_dir}/{line}')}", file=sys.stderr)
        if args.json:
            doc = {"ts": time.time(), "ranks": {t: _json_samples(m) for t, m in results.items()},
                   "errors": errors, "warnings": damage.lines(), "damaged": damage.to_json(),
                   "activity": {t: a.to_json() for t, a in activity.items()}, "hang": hang,
                   "stragglers": straggler_scores(results, previous)}
            print(json.dumps(doc, default=str), flush=True)
        elif not targets:
            console.print("no rank endpoints found" + (f" in {args.sd_dir}" if args.sd_dir else ""))
        else:
            if not args.once:
                console.clear()
            console.print(_table(results, previous, now - last))
            if hang is not None:
                console.print(f"[red]{shown(_hang_line(hang))}", soft_wrap=True)
            for target in sorted(t for t, m in results.items() if m is None):
                why = errors.get(target, "no answer")  # a table cell is too narrow for either
                console.print(f"[red]{shown(target)} down: {shown(why)}", soft_wrap=True)
            for _target, message in sorted(errors.items()):
                if results.get(_target, {}) is not None:
                    console.print(f"[red]{shown(message)}", soft_wrap=True)
        previous = {t: m for t, m in results.items() if m is not None}
        last = now
        if args.once:
            return 0 if targets and any(m is not None for m in results.values()) else 1
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
