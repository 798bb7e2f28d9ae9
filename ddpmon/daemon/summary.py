"""A job's live summary, scraped from its ranks' /metrics endpoints.

Only a handful of headline series are kept per rank (step, loss, norms, loss scale, skipped and
non-finite counts); the last values seen are retained after a rank exits, so a finished job still
shows where it got to.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HEADLINE = {
    "ddpmon_step": "step",
    "ddpmon_loss": "loss",
    "ddpmon_grad_norm": "grad_norm",
    "ddpmon_amp_loss_scale": "loss_scale",
    "ddpmon_steps_total": "steps_total",
    "ddpmon_amp_skipped_steps_total": "skipped_steps_total",
    "ddpmon_grad_nonfinite_steps_total": "nonfinite_steps_total",
    "ddpmon_world_size": "world_size",
}


def parse_headline(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = HEADLINE.get(sample.name)
            if key is not None and key not in values:
                values[key] = float(sample.value)
    return values


def scrape(host: str, port: int, timeout: float = 0.5) -> dict[str, float] | None:
    """Headline values from one rank, or None when it does not answer (yet, or any more)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
            text = resp.read(4_000_000).decode("utf-8", "replace")
        return parse_headline(text)
    except Exception:
        return None


def merge(previous: dict[str, Any], host: str, ports: list[int]) -> dict[str, Any]:
    """Scrape every rank port and fold the answers into ``previous`` (kept values persist)."""
    now = time.time()
    ranks: dict[str, Any] = dict(previous.get("ranks", {}))
    up = 0
    for local_rank, port in enumerate(ports):
        values = scrape(host, port)
        if values is None:
            if str(local_rank) in ranks:
                ranks[str(local_rank)]["up"] = False
            continue
        up += 1
        ranks[str(local_rank)] = {**values, "port": port, "up": True, "scraped_at": now}
    summary: dict[str, Any] = {"ranks": ranks, "ranks_up": up, "updated_at": now}
    steps = [r["step"] for r in ranks.values() if "step" in r]
    if steps:
        summary["min_step"], summary["max_step"] = min(steps), max(steps)
    summary["scrapes_ok"] = int(previous.get("scrapes_ok", 0)) + up
    return summary
