"""The goodput buckets, declared once: their names (Google's ml-goodput-measurement names where
one fits), what each holds, and whether Meta's ETTR counts it as productive runtime.

Every second of a job's wall-clock time, from the first process start of its first attempt to
now (or to its end), falls in exactly one bucket; the reader (:mod:`.account`) paints the time
line of each rank and the buckets add up to the wall-clock time by construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str
    """The label value of ``ddpmon_goodput_seconds{bucket=...}`` and the JSON key."""
    google: str
    """The ml-goodput-measurement ``BadputType`` (or ``GOODPUT``) it corresponds to."""
    meaning: str
    ettr_productive: bool
    """Counted as productive runtime in the ETTR-compatible ratio."""


PRODUCTIVE = "productive"
LOST = "wasted_progress_from_disruption"
INIT = "initialization"
WARMUP = "program_startup"
DATA = "data_loading_sync"
SAVE = "unproductive_checkpoint_save"
RESTORE = "unproductive_checkpoint_restore"
DETECT = "failure_detection"
GAP = "restart_gap"
CUSTOM = "custom_badput_events"
OTHER = "other"

BUCKETS: tuple[Bucket, ...] = (
    Bucket(PRODUCTIVE, "GOODPUT (productive step time)",
           "step time (first forward to the end of the optimizer step) of steps whose progress "
           "was kept; a warm-up step counts its steady step time here", True),
    Bucket(LOST, "WASTED_PROGRESS_FROM_DISRUPTION",
           "step time of steps computed again after a restart from an older checkpoint (or "
           "from scratch)", False),
    Bucket(INIT, "TPU_INITIALIZATION + TRAINING_PREP",
           "process start to the first step of each attempt (imports, process group, model "
           "build), less the checkpoint load inside it", False),
    Bucket(WARMUP, "PROGRAM_STARTUP",
           "compilation and warm-up: what the first steps of an attempt took beyond the run's "
           "steady step time", True),
    Bucket(DATA, "DATA_LOADING_SYNC",
           "the end of one step to the first forward of the next (waiting for the batch)", True),
    Bucket(SAVE, "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
           "blocking checkpoint save time (`observe_checkpoint`, DCP save/async_save staging)",
           False),
    Bucket(RESTORE, "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
           "checkpoint load time of a resume", False),
    Bucket(DETECT, "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION (part)",
           "a failed attempt's last completed step to the attempt's end (its last event on any "
           "rank): a hang until the collective timeout or the launcher ends it", False),
    Bucket(GAP, "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION (part)",
           "an attempt's end to the next attempt's process start (torchelastic restarts, "
           "Slurm requeues, a relaunch by hand)", False),
    Bucket(CUSTOM, "CUSTOM_BADPUT_EVENTS",
           "phases the script marks (`mon.phase(\"eval\")`): evaluation and the like", True),
    Bucket(OTHER, "OTHER",
           "time inside an attempt that none of the above explains (between steps, after the "
           "last step of a run that ended well); should stay small", False),
)
BY_NAME = {b.name: b for b in BUCKETS}
NAMES = tuple(b.name for b in BUCKETS)

PRIORITY = {SAVE: 4, RESTORE: 4, CUSTOM: 3, PRODUCTIVE: 2, LOST: 2, WARMUP: 2, DATA: 1}
"""Where measured intervals overlap, the higher wins: a checkpoint save between two steps sits
inside the next step's data wait (the agent measures that wait from the end of one step to the
first forward of the next), and counts as the save."""
