"""Reading ranks' /metrics endpoints from the command line tools (``demo``, ``top``)."""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from pathlib import Path


def scrape(target: str, timeout: float = 1.0) -> dict[str, float]:
    """Samples of one endpoint (``host:port``), keyed by name; labelled series beyond run/rank
    are summed per name (e.g. ``ddpmon_agent_errors_total`` over probes)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sample.labels.keys() - {"run", "rank"}
            if not extra:
                out[sample.name] = sample.value
            elif sample.name == "ddpmon_agent_errors_total":
                out[sample.name] += sample.value
            elif sample.name == "ddpmon_rank_info":
                out["rank"] = float(sample.labels.get("rank", "nan"))
    return dict(out)


def targets_from_sd_dir(sd_dir: str | Path, run: str | None = None) -> list[tuple[str, dict]]:
    """``(target, labels)`` of every rank published into a file_sd directory."""
    found = []
    for path in sorted(Path(sd_dir).glob("*.json")):
        try:
            groups = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now, or not ours
        for group in groups if isinstance(groups, list) else []:
            labels = group.get("labels", {})
            if run is not None and labels.get("run") != run:
                continue
            found.extend((t, labels) for t in group.get("targets", []))
    return found
