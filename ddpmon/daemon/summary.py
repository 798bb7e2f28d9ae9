"""A job's live summary, scraped from its ranks' /metrics endpoints.

Only a handful of headline series are kept per rank (step, loss, norms, loss scale, skipped and
non-finite counts); the last values seen are retained after a rank exits, so a finished job still
shows where it got to. Scrapes go through the shared ``ScrapeClient``, so ranks that serve TLS
and basic auth are read with the daemon config's ``scrape_config``.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .. import metrics
from ..export.scrape import ScrapeClient, ScrapeError, Target
from ..rundir.safe_read import load_json
from .hang_naming import RankActivity, name_hang, parse_activity

HEADLINE = {
    metrics.STEP.name: "step",
    metrics.LOSS.name: "loss",
    metrics.GRAD_NORM.name: "grad_norm",
    metrics.AMP_LOSS_SCALE.name: "loss_scale",
    metrics.STEPS.name: "steps_total",
    metrics.STEPS_SKIPPED.name: "skipped_steps_total",
    metrics.GRAD_NONFINITE_STEPS.name: "nonfinite_steps_total",
    metrics.WORLD_SIZE.name: "world_size",
}
"""Catalogue metric -> key in the job summary (the keys are the daemon API's contract)."""

_PLAIN = ScrapeClient()
"""Plain http, no auth: what a rank without ``web_config`` serves."""


def parse_headline(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = HEADLINE.get(sample.name)
            if key is not None and key not in values:
                values[key] = float(sample.value)
    return values


def scrape(
    host: str, port: int, timeout: float = 0.5, client: ScrapeClient | None = None
) -> dict[str, Any]:
    """Headline values from one rank and its ``activity`` (phase, collectives, where it is
    stuck: ``hang_naming``); ``ScrapeError`` when it does not answer (yet, or any more) or
    refuses the client (the message says why)."""
    client = client or _PLAIN
    target = Target(client.config.scheme, host, port, client.config.metrics_path)
    try:
        text = client.fetch(target, timeout)
        return {**parse_headline(text), "activity": parse_activity(text).to_json()}
    except ValueError as exc:  # not an exposition
        raise ScrapeError(f"{target.url}: unreadable answer: {exc}") from exc


def merge(
    previous: dict[str, Any], host: str, ports: list[int], client: ScrapeClient | None = None
) -> dict[str, Any]:
    """Scrape every rank port and fold the answers into ``previous`` (kept values persist)."""
    now = time.time()
    ranks: dict[str, Any] = dict(previous.get("ranks", {}))
    up = 0
    errors: dict[str, str] = {}
    for local_rank, port in enumerate(ports):
        try:
            values = scrape(host, port, client=client)
        except ScrapeError as exc:
            errors[str(local_rank)] = str(exc)
            if str(local_rank) in ranks:
                ranks[str(local_rank)]["up"] = False
                ranks[str(local_rank)].pop("activity", None)  # not what it does now
            continue
        up += 1
        ranks[str(local_rank)] = {**values, "port": port, "up": True, "scraped_at": now}
    summary: dict[str, Any] = {"ranks": ranks, "ranks_up": up, "updated_at": now}
    steps = [r["step"] for r in ranks.values() if "step" in r]
    if steps:
        summary["min_step"], summary["max_step"] = min(steps), max(steps)
    summary["scrapes_ok"] = int(previous.get("scrapes_ok", 0)) + up
    hang = name_hang([RankActivity(**r["activity"]) for r in ranks.values()
                      if r.get("up") and isinstance(r.get("activity"), dict)])
    if hang is not None:
        summary["hang"] = hang  # among this node's ranks (docs/slow-and-stuck/hangs.md)
    if errors:
        summary["scrape_errors"] = errors
    return summary


FINAL_KEYS = {
    "last_step": "step",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "loss_scale": "loss_scale",
    "steps": "steps_total",
    "skipped_steps": "skipped_steps_total",
    "grad_nonfinite_steps": "nonfinite_steps_total",
}
"""``summary.rank<R>.json`` key -> key in the job summary."""
_SUMMARY_FILE = re.compile(r"summary\.rank(\d{1,7})\.json")
MAX_RANK_FILES = 1024


def merge_final(previous: dict[str, Any], run_path: Path) -> dict[str, Any]:
    """Fold the ranks' final ``summary.rank<R>.json`` (written at close, after the last step)
    into a finished job's summary. Scrapes only see what a rank served before it closed, which
    can miss the last step; the files cannot. A file that is missing, damaged or of another
    shape is skipped: the scraped values stay."""
    ranks: dict[str, Any] = {k: dict(v) for k, v in previous.get("ranks", {}).items()}
    try:
        names = sorted(p.name for p in run_path.iterdir())[:100_000]
    except OSError:
        return previous
    found = 0
    for name in names:
        m = _SUMMARY_FILE.fullmatch(name)
        if m is None or found >= MAX_RANK_FILES:
            continue
        try:
            doc = load_json(run_path / name)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        found += 1
        entry = ranks.setdefault(str(int(m.group(1))), {})
        for key, into in FINAL_KEYS.items():
            value = doc.get(key)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and (math.isfinite(value) or into == "loss"):  # a NaN loss is news
                entry[into] = float(value)
        entry["final"] = True
    if not found:
        return previous
    summary = {**previous, "ranks": ranks}
    steps = [r["step"] for r in ranks.values() if isinstance(r.get("step"), float | int)]
    if steps:
        summary["min_step"], summary["max_step"] = min(steps), max(steps)
    return summary
