"""What each file of a run directory holds, who writes it and how: the table behind
``docs/reference/files.md``.

The names themselves live in :mod:`ddpmon.rundir.layout`; this table describes them. A test checks
that every name and pattern ``rundir`` declares has exactly one entry here, so a new file
cannot ship undocumented.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout as rundir

__all__ = ["FILES", "RunDirFile"]


@dataclass(frozen=True, slots=True)
class RunDirFile:
    name: str
    """The name as users see it (``<R>`` is the global rank, ``<S>`` the step)."""
    source: str
    """The ``ddpmon.rundir.layout`` constant that names it (its regex or constant)."""
    written: str
    contents: str
    read_by: str


FILES: tuple[RunDirFile, ...] = (
    RunDirFile(
        "events.rank<R>.jsonl", "EVENTS_RE",
        "append-only, one `os.write` per line, never rewritten",
        "one JSON object per line (see [Events](events.md)); NaN/Inf as strings",
        "timeline, report, daemon (first failure)",
    ),
    RunDirFile(
        "progress.rank<R>.json", "PROGRESS_RE",
        "overwritten in place, 64 bytes per 50 ms batch of steps (no fsync)",
        "`{\"step\", \"ts\"}`: last completed step and its time; survives SIGKILL/SIGSEGV "
        "(page cache)",
        "timeline (a vanished rank's last step)",
    ),
    RunDirFile(
        "summary.rank<R>.json", "SUMMARY_RE", "atomically at close",
        "the rank's end-of-run figures (steps, norms, loss scale, all-reduce p50/p99, agent "
        "errors)",
        "the demo's summary, report",
    ),
    RunDirFile(
        "manifest.json", "MANIFEST",
        "by rank 0 only, atomically, at attach and after the first batch",
        "the run's manifest: versions, topology (every rank's node, pid, device, GPU UUID under "
        "`topology.hosts`), strategy, precision, attempt, recovery",
        "manifest, compare, report, timeline",
    ),
    RunDirFile(
        "manifest.rank<R>.json", "LEGACY_MANIFEST_RE", "by older versions only (never now)",
        "per-rank manifests of runs made before `manifest.json` held every rank",
        "manifest",
    ),
    RunDirFile(
        "annotations.json", "ANNOTATIONS", "by rank 0, atomically, on `mon.annotate(...)`",
        "run facts only the script knows: `global_batch`, `micro_batch`, `accumulation`, "
        "`seed`",
        "compare, report",
    ),
    RunDirFile(
        "crash.rank<R>.txt", "CRASH_RE",
        "by `faulthandler` on SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL, after the attempt's "
        "`ddpmon-live` line (the step in progress, kept current through a shared mapping)",
        "`Fatal Python error: ...` and every thread's stack, each dump after its attempt's live "
        "line (removed at a clean end when nothing followed the line)",
        "timeline (a `signal` row)",
    ),
    RunDirFile(
        "sigterm.rank<R>.txt", "SIGTERM_RE",
        "on SIGTERM (`faulthandler.register`, chained: the process still dies at once)",
        "every thread's stack when the launcher stopped the rank, after the attempt's "
        "`ddpmon-live` line (removed when nothing followed it)",
        "timeline",
    ),
    RunDirFile(
        "history.rank<R>.arrow", "HISTORY_RE",
        "append-only Arrow IPC stream (zstd) by the record thread; sealed batches fsynced",
        "one row per optimizer step (see [the history schema](#the-history-schema))",
        "compare, report",
    ),
    RunDirFile(
        "history.rank<R>.tail.arrow", "HISTORY_JOURNAL_RE",
        "the history's journal, flushed every second while the rank runs; removed at close",
        "rows not yet sealed into `history.rank<R>.arrow`; readers merge both",
        "compare, report",
    ),
    RunDirFile(
        "evidence/rank<R>-step<S>-<kind>[-<n>]/", "BUNDLE_RE",
        "atomically (a `.tmp-rank<R>-<pid>-*` directory, fsync, rename); at most "
        "`evidence_max_per_kind` per kind and rank",
        "`info.json`, `records.json`, `extra.json`, `rng.json`, `rng_state.pt`, `stacks.txt`, "
        "small offending tensors (see [Forensics](../forensics/index.md#evidence-bundles))",
        "timeline, report",
    ),
    RunDirFile(
        "evidence/.tmp-rank<R>-<pid>-*/", "BUNDLE_TMP_RE",
        "while a bundle is written; removed by the rank's next writer if the process died",
        "an unfinished bundle: never read",
        "nobody",
    ),
    RunDirFile(
        "flight_recorder/fr_trace_rank_<R>[.json]", "FLIGHT_RECORDER_JSON_RE",
        "on a stall", "torch.distributed flight-recorder dump: pickle for "
        "`python -m torch.distributed.flight_recorder.fr_trace`, JSON twin for ddpmon",
        "timeline (who stopped first in a hang)",
    ),
    RunDirFile(
        "flight_recorder.rank<R>.json", "LEGACY_FLIGHT_RECORDER_JSON_RE",
        "by older versions only", "the former name of the JSON dump", "timeline",
    ),
    RunDirFile(
        "checkpoints/step-<S>.pt", "",
        "by the demo's `--checkpoint-every` (your script writes its own checkpoints wherever "
        "it likes)",
        "model, optimizer, GradScaler and RNG state", "the demo's `--resume`",
    ),
    RunDirFile(
        "<sd_dir>/ddpmon-<run>-rank<R>.json", "SD_RE",
        "in the `sd_dir` (not the run dir), atomically at attach; removed at a clean exit",
        "a Prometheus `file_sd` target with labels `run`, `rank`, `node`, `local_rank`",
        "Prometheus, `ddpmon top --sd-dir`",
    ),
)


def declared_names() -> set[str]:
    """Every public name or pattern ``ddpmon.rundir.layout`` declares for a file."""
    return {
        name for name, value in vars(rundir).items()
        if name.isupper() and not name.startswith("_")
        and (hasattr(value, "pattern") or (isinstance(value, str) and "." in value))
    }
