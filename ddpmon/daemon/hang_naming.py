"""Who the others wait for: a live hang named from the ranks' activity series.

Each rank exports its phase, each process group's last issued collective sequence number, the
collective it has not completed, and, once it made no progress for ``hang_seconds``, where it
is stuck (``agent.activity``). From those of every rank of a run:

- the *waiting* ranks are the ranks with a collective in flight (a rank exports it after a
  second without progress); the group most of them wait on is the hung group, the highest
  sequence number they wait in is the collective;
- the ranks the others wait for (the *holders*) are the ranks whose last issued sequence number
  on that group is below it: they never entered that collective (stuck in a data loader, in
  user code, in another group's collective after skipping this one);
- it pages once a holder is stuck past ``hang_seconds`` outside a ``quiet`` phase (a
  checkpoint, an evaluation marked with ``mon.phase``, before the first step).

The same rule is the alert ``DdpmonHangHolder`` (``mixin/alerts/hangs.py``); ``ddpmon top``
reads it from the ranks' endpoints.

Ranks that all entered the hung sequence number name no holder; where they entered it with
different ops (one rank in a broadcast, the others in an all-reduce: a real hang, every rank
waits for a partner that never comes), the ranks whose op differs from the majority's are the
*mismatch* (``DdpmonCollectiveMismatch``). Sizes are not compared: the ranks do not export them
(gloo aborts on a size mismatch rather than hanging).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .. import metrics as m
from ..terminal import clean_line


@dataclass(slots=True)
class RankActivity:
    """One rank's activity series, as scraped."""

    rank: int | None = None
    phase: str | None = None
    phase_since: float | None = None
    sequences: dict[str, int] = field(default_factory=dict)
    inflight: dict[str, dict[str, Any]] = field(default_factory=dict)
    """group -> ``{"op", "seq", "since"}``."""
    stuck_seconds: float | None = None
    frame: str | None = None
    quiet: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self.phase, "phase_since": self.phase_since,
                "sequences": self.sequences, "inflight": self.inflight,
                "stuck_seconds": self.stuck_seconds, "frame": self.frame, "quiet": self.quiet}


ACTIVITY = frozenset(x.name for x in (m.PHASE_SINCE, m.COLLECTIVE_SEQUENCE, m.STUCK,
                                      m.COLLECTIVE_INFLIGHT_SINCE, m.COLLECTIVE_INFLIGHT_SEQUENCE))
"""The activity families (``agent.activity``); any of them carries the rank."""


def parse_activity(text: str) -> RankActivity:
    """The activity series of one rank's exposition text (other series are ignored)."""
    act = RankActivity()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels, value = s.labels, s.value
            if s.name in ACTIVITY and act.rank is None:
                act.rank = _int(labels.get("rank"))
            if s.name == m.PHASE_SINCE.name:
                act.phase, act.phase_since = clean_line(labels.get("phase", "")), value
            elif s.name == m.COLLECTIVE_SEQUENCE.name:
                act.sequences[clean_line(labels.get("group", ""))] = int(value)
            elif s.name in (m.COLLECTIVE_INFLIGHT_SEQUENCE.name, m.COLLECTIVE_INFLIGHT_SINCE.name):
                entry = act.inflight.setdefault(clean_line(labels.get("group", "")), {})
                entry["op"] = clean_line(labels.get("op", ""))
                key = "seq" if s.name == m.COLLECTIVE_INFLIGHT_SEQUENCE.name else "since"
                entry[key] = int(value) if key == "seq" else value
            elif s.name == m.STUCK.name:
                act.stuck_seconds = value
                act.frame = clean_line(labels.get("frame", ""))
                act.quiet = labels.get("quiet") == "1"
                act.phase = act.phase or clean_line(labels.get("phase", ""))
    return act


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def name_hang(ranks: list[RankActivity]) -> dict[str, Any] | None:
    """The hung collective, the ranks waiting in it and the ranks they wait for; None while no
    rank waits in a collective. It pages once a holder is stuck outside a quiet phase."""
    waiting = [(a, g, f) for a in ranks for g, f in a.inflight.items() if "seq" in f]
    if not waiting:
        return None
    per_group = Counter(g for _, g, _ in waiting)
    group = min(per_group, key=lambda g: (-per_group[g], g))
    in_group = [(a, f) for a, g, f in waiting if g == group]
    seq = max(f["seq"] for _, f in in_group)
    at_seq = [(a, f) for a, f in in_group if f["seq"] == seq]
    op = Counter(f["op"] for _, f in at_seq).most_common(1)[0][0]
    since = min((f.get("since") for _, f in at_seq if f.get("since") is not None), default=None)
    holders = [
        {"rank": a.rank, "phase": a.phase, "frame": a.frame, "quiet": a.quiet,
         "stuck_seconds": a.stuck_seconds, "seq": a.sequences[group]}
        for a in ranks if group in a.sequences and a.sequences[group] < seq
    ]
    holders.sort(key=lambda h: (h["rank"] is None, h["rank"]))
    mismatch = [] if holders else mismatched(at_seq)
    pages = any(h["stuck_seconds"] is not None and not h["quiet"] for h in holders + mismatch)
    return {
        "collective": {"op": op, "group": group, "seq": seq, "since": since},
        "waiting": sorted(a.rank for a, _ in at_seq if a.rank is not None),
        "holders": holders,
        "mismatch": mismatch,
        "pages": pages,
    }


def mismatched(at_seq: list[tuple[RankActivity, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ranks in the hung collective's sequence number with an op other than the one most
    of them are in (none on a tie: no majority to name against)."""
    ops = Counter(f["op"] for _, f in at_seq).most_common()
    if len(ops) < 2 or ops[0][1] == ops[1][1]:
        return []
    out = [{"rank": a.rank, "op": f["op"], "phase": a.phase, "frame": a.frame, "quiet": a.quiet,
            "stuck_seconds": a.stuck_seconds} for a, f in at_seq if f["op"] != ops[0][0]]
    return sorted(out, key=lambda h: (h["rank"] is None, h["rank"]))
