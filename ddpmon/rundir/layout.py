"""Every file name of a run directory (``run_dir/<run_id>/``), and the patterns that read them back.

Why one module: the agent writes these files, ``ddpmon timeline``/``manifest`` and the daemon
read them, and a name built by hand in two places drifts (the flight-recorder dump once had two
names). Writers ask :class:`RunDir` for a path; readers use the same class or the regexes below.

Layout (``<R>`` is the global rank)::

    events.rank<R>.jsonl          append-only event log (recorder/eventlog.py)
    progress.rank<R>.json         last completed step, overwritten in place
    summary.rank<R>.json          end-of-run summary, written at close
    manifest.json                 the run manifest, written once by rank 0
    crash.rank<R>.txt             faulthandler output after a fatal signal (absent when clean)
    sigterm.rank<R>.txt           stacks dumped at SIGTERM (absent when clean)
    history.rank<R>.arrow         per-rank numerics history (reserved name)
    evidence/rank<R>-step<S>-<kind>[-<n>]/   evidence bundles (built in .tmp-rank<R>-<pid>-*)
    flight_recorder/fr_trace_rank_<R>[.json] torch flight-recorder dump (pickle + JSON twin)

Older runs may also hold ``manifest.rank<R>.json`` (per-rank manifests) and
``flight_recorder.rank<R>.json`` (the agent's former dump name); readers still accept both.

The Prometheus ``file_sd`` file of a rank lives in the ``sd_dir``, not in the run dir:
:func:`sd_filename` names it ``ddpmon-<run>-rank<R>.json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

EVENTS_RE = re.compile(r"^events\.rank(\d+)\.jsonl$")
PROGRESS_RE = re.compile(r"^progress\.rank(\d+)\.json$")
SUMMARY_RE = re.compile(r"^summary\.rank(\d+)\.json$")
CRASH_RE = re.compile(r"^crash\.rank(\d+)\.txt$")
SIGTERM_RE = re.compile(r"^sigterm\.rank(\d+)\.txt$")
HISTORY_RE = re.compile(r"^history\.rank(\d+)\.arrow$")
HISTORY_JOURNAL_RE = re.compile(r"^history\.rank(\d+)\.tail\.arrow$")
ANNOTATIONS = "annotations.json"
"""Run facts the user declares (global batch, accumulation, seed), written by rank 0."""


def history_journal_of(history: Path) -> Path:
    """The journal beside ``history.rank<R>.arrow``: ``history.rank<R>.tail.arrow`` (rows not yet
    sealed into the main file; present while a rank runs, or after it crashed)."""
    return history.with_name(history.name[: -len(".arrow")] + ".tail.arrow")
MANIFEST = "manifest.json"
LEGACY_MANIFEST_RE = re.compile(r"^manifest\.rank(\d+)\.json$")

EVIDENCE_DIR = "evidence"
BUNDLE_RE = re.compile(r"^rank(\d+)-step(-?\d+|none)-([A-Za-z0-9_]+)(?:-\d+)?$")
BUNDLE_TMP_RE = re.compile(r"^\.tmp-rank(\d+)-(\d+)-")

FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "fr_trace_rank_"
FLIGHT_RECORDER_JSON_RE = re.compile(rf"^{FLIGHT_RECORDER_PREFIX}(\d+)\.json$")
"""JSON twin of a dump, inside :data:`FLIGHT_RECORDER_DIR`."""
LEGACY_FLIGHT_RECORDER_JSON_RE = re.compile(r"^flight_recorder\.rank(\d+)\.json$")
"""The agent's former dump name, directly in the run dir; read for old runs, never written."""

SD_RE = re.compile(r"^ddpmon-(.+)-rank(\d+)\.json$")


def sd_filename(run_id: str, rank: int) -> str:
    """The ``file_sd`` target file name of one rank: ``ddpmon-<run>-rank<R>.json``."""
    run_id = str(run_id)
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise ValueError(f"run_id={run_id!r}: expected a non-empty name without '/'")
    return f"ddpmon-{run_id}-rank{_rank(rank)}.json"


def safe_kind(kind: str) -> str:
    """An evidence kind reduced to the characters a bundle name allows."""
    return re.sub(r"[^A-Za-z0-9_]", "_", str(kind))[:40] or "_"


def bundle_name(rank: int, step: int | None, kind: str) -> str:
    """``rank<R>-step<S>-<kind>`` (``stepnone`` when not tied to a step)."""
    return f"rank{_rank(rank)}-step{'none' if step is None else int(step)}-{safe_kind(kind)}"


def parse_bundle_name(name: str) -> tuple[int, int | None, str] | None:
    """``(rank, step, kind)`` of a bundle directory name; None for temp dirs and strangers."""
    m = BUNDLE_RE.match(name)
    if not m:
        return None
    step = None if m.group(2) == "none" else int(m.group(2))
    return int(m.group(1)), step, m.group(3)


def bundle_tmp_prefix(rank: int, pid: int) -> str:
    """Prefix of a bundle's temporary directory; :data:`BUNDLE_TMP_RE` reads rank and pid back,
    so a later writer of the same rank can remove what a dead process left."""
    return f".tmp-rank{_rank(rank)}-{int(pid)}-"


@dataclass(frozen=True, slots=True)
class RunDir:
    """The files of one run: ``RunDir(run_dir / run_id)``. Paths only; nothing is created."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, run_dir: Path | str, run_id: str) -> RunDir:
        """The run ``run_id`` under the parent directory ``run_dir``."""
        if not run_id or "/" in str(run_id):
            raise ValueError(f"run_id={run_id!r}: expected a non-empty name without '/'")
        return cls(Path(run_dir) / str(run_id))

    # -- per-rank files ---------------------------------------------------------------------
    def events(self, rank: int) -> Path:
        return self.path / f"events.rank{_rank(rank)}.jsonl"

    def progress(self, rank: int) -> Path:
        return self.path / f"progress.rank{_rank(rank)}.json"

    def summary(self, rank: int) -> Path:
        return self.path / f"summary.rank{_rank(rank)}.json"

    def crash(self, rank: int) -> Path:
        return self.path / f"crash.rank{_rank(rank)}.txt"

    def sigterm(self, rank: int) -> Path:
        return self.path / f"sigterm.rank{_rank(rank)}.txt"

    def history(self, rank: int) -> Path:
        return self.path / f"history.rank{_rank(rank)}.arrow"

    def annotations(self) -> Path:
        return self.path / ANNOTATIONS

    def manifest(self) -> Path:
        return self.path / MANIFEST

    def legacy_manifest(self, rank: int) -> Path:
        """``manifest.rank<R>.json``, written by older versions for ranks other than 0."""
        return self.path / f"manifest.rank{_rank(rank)}.json"

    # -- evidence -----------------------------------------------------------------------------
    @property
    def evidence_dir(self) -> Path:
        return self.path / EVIDENCE_DIR

    def evidence_bundle(self, rank: int, step: int | None, kind: str) -> Path:
        """The first-choice bundle path; a writer appends ``-2``, ``-3``... if it exists."""
        return self.evidence_dir / bundle_name(rank, step, kind)

    def bundles(self) -> list[Path]:
        """Complete bundles (temporary directories excluded), sorted by name."""
        try:
            return sorted(
                p for p in self.evidence_dir.iterdir() if p.is_dir() and BUNDLE_RE.match(p.name)
            )
        except OSError:
            return []

    # -- flight recorder ----------------------------------------------------------------------
    @property
    def flight_recorder_dir(self) -> Path:
        return self.path / FLIGHT_RECORDER_DIR

    def flight_recorder(self, rank: int) -> Path:
        """The pickle dump (what ``torch.distributed.flight_recorder.fr_trace`` reads)."""
        return self.flight_recorder_dir / f"{FLIGHT_RECORDER_PREFIX}{_rank(rank)}"

    def flight_recorder_json(self, rank: int) -> Path:
        """The JSON twin next to the pickle, which ``ddpmon timeline`` reads."""
        return self.flight_recorder_dir / f"{FLIGHT_RECORDER_PREFIX}{_rank(rank)}.json"

    def flight_recorder_dumps(self) -> dict[int, Path]:
        """rank -> JSON dump, from the current layout or, for old runs, the legacy name."""
        found = self.ranked(LEGACY_FLIGHT_RECORDER_JSON_RE)
        found.update(_ranked(self.flight_recorder_dir, FLIGHT_RECORDER_JSON_RE))
        return found

    # -- reading back -------------------------------------------------------------------------
    def ranked(self, pattern: re.Pattern[str]) -> dict[int, Path]:
        """rank -> path of the files directly in the run dir whose name ``pattern`` matches
        (its first group is the rank), e.g. ``ranked(EVENTS_RE)``."""
        return _ranked(self.path, pattern)

    def is_run(self) -> bool:
        """True when the directory holds a run's files (an event log, crash file or manifest)."""
        try:
            return any(
                EVENTS_RE.match(p.name) or CRASH_RE.match(p.name) or p.name == MANIFEST
                for p in self.path.iterdir()
            )
        except OSError:
            return False


def _ranked(directory: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    out: dict[int, Path] = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return out
    for p in entries:
        m = pattern.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _rank(rank: int) -> int:
    r = int(rank)
    if r < 0:
        raise ValueError(f"rank={rank!r}: expected >= 0")
    return r
