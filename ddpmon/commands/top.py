"""``ddpmon top``: every rank of a run in one terminal table, columns in layer order
(numerics, data supply, memory, communication), read straight from the ranks' endpoints."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="live per-rank table scraped from the ranks' /metrics")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--sd-dir", help="file_sd directory the ranks publish into")
    src.add_argument("--targets", nargs="+", metavar="HOST:PORT", help="rank endpoints")
    p.add_argument("--run", default=None, help="only this run (with --sd-dir)")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period, seconds")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--json", action="store_true", help="one JSON document per refresh")
    p.set_defaults(func=run)


COLUMNS = (
    # (header, layer, function of (current, previous, seconds) -> str)
    ("rank", "", lambda m, p, dt: _int(m.get("rank"))),
    ("step", "", lambda m, p, dt: _int(m.get("ddpmon_step"))),
    ("loss", "numerics", lambda m, p, dt: _num(m.get("ddpmon_loss"))),
    ("grad norm", "numerics", lambda m, p, dt: _num(m.get("ddpmon_grad_norm"))),
    ("local norm", "numerics", lambda m, p, dt: _num(m.get("ddpmon_grad_local_norm"))),
    (
        "NaN origin",
        "numerics",
        lambda m, p, dt: _int(m.get("ddpmon_grad_nonfinite_origin_steps_total")),
    ),
    ("scale", "numerics", lambda m, p, dt: _num(m.get("ddpmon_amp_loss_scale"))),
    ("skipped", "numerics", lambda m, p, dt: _int(m.get("ddpmon_amp_skipped_steps_total"))),
    ("steps/s", "data", lambda m, p, dt: _rate(m, p, dt, "ddpmon_steps_total")),
    ("data wait", "data", lambda m, p, dt: _mean_ms(m, "ddpmon_data_wait_seconds")),
    ("dup batches", "data", lambda m, p, dt: _int(m.get("ddpmon_data_identical_batches_total"))),
    ("RSS", "memory", lambda m, p, dt: _bytes(m.get("ddpmon_process_resident_memory_bytes"))),
    ("CUDA alloc", "memory", lambda m, p, dt: _bytes(m.get("ddpmon_cuda_memory_allocated_bytes"))),
    ("all-reduce", "comm", lambda m, p, dt: _mean_ms(m, "ddpmon_allreduce_duration_seconds")),
    ("step time", "comm", lambda m, p, dt: _mean_ms(m, "ddpmon_step_duration_seconds")),
    ("errors", "", lambda m, p, dt: _int(m.get("ddpmon_agent_errors_total"))),
)


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


def _mean_ms(m: dict, name: str) -> str:
    count, total = m.get(f"{name}_count"), m.get(f"{name}_sum")
    return "-" if not count else f"{total / count * 1000:.1f} ms"


def _rate(m: dict, prev: dict | None, dt: float, name: str) -> str:
    if not prev or dt <= 0 or name not in m or name not in prev:
        return "-"
    return f"{(m[name] - prev[name]) / dt:.2f}"


def _targets(args: argparse.Namespace) -> list[str]:
    if args.targets:
        return list(args.targets)
    from ..export.scrape import targets_from_sd_dir

    return [t for t, _ in targets_from_sd_dir(args.sd_dir, args.run)]


def _collect(targets: list[str]) -> dict[str, dict | None]:
    from ..export.scrape import scrape

    def one(target: str) -> dict | None:
        try:
            return scrape(target)
        except Exception:
            return None

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return dict(zip(targets, pool.map(one, targets), strict=True))


def _table(results: dict[str, dict | None], previous: dict, dt: float):
    from rich.table import Table

    table = Table(title=f"ddpmon top: {len(results)} rank endpoint(s)")
    for header, layer, _ in COLUMNS:
        table.add_column(f"{header}\n[dim]{layer}[/]" if layer else header, justify="right")
    rows = []
    for target, m in results.items():
        if m is None:
            rows.append((float("inf"), [f"[red]{target} down", *[""] * (len(COLUMNS) - 1)]))
            continue
        cells = [fn(m, previous.get(target), dt) for _, _, fn in COLUMNS]
        rows.append((m.get("rank", float("inf")), cells))
    for _, cells in sorted(rows, key=lambda r: r[0]):
        table.add_row(*cells)
    return table


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    previous: dict[str, dict] = {}
    last = time.monotonic()
    while True:
        targets = _targets(args)
        results = _collect(targets)
        now = time.monotonic()
        if args.json:
            print(json.dumps({"ts": time.time(), "ranks": results}, default=str), flush=True)
        else:
            if not targets:
                console.print(
                    "no rank endpoints found" + (f" in {args.sd_dir}" if args.sd_dir else "")
                )
            else:
                if not args.once:
                    console.clear()
                console.print(_table(results, previous, now - last))
        previous = {t: m for t, m in results.items() if m is not None}
        last = now
        if args.once:
            return 0 if targets and any(m is not None for m in results.values()) else 1
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
