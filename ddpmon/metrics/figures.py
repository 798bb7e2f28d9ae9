"""The run figures' series: goodput (rank 0, from the run dir) and FLOPs and MFU (per rank).
Part of the catalogue (``ddpmon.metrics``), after a rank's own series; docs/goodput.md."""

from __future__ import annotations

from .types import Layer, Metric, MetricType

G, C, H = MetricType.GAUGE, MetricType.COUNTER, MetricType.HISTOGRAM
L = Layer

# -- goodput (rank 0, from the run dir; docs/goodput.md) -----------------------------------
_GOODPUT_WHEN = "rank 0, once goodput_seconds after attach (goodput_seconds=0: never)"
GOODPUT_SECONDS = Metric(
    "ddpmon_goodput_seconds",
    G,
    "The run's wall-clock time since its first process start, split into buckets that add up "
    "to ddpmon_goodput_wall_seconds (productive, wasted_progress_from_disruption, "
    "initialization, program_startup, data_loading_sync, unproductive_checkpoint_save, "
    "unproductive_checkpoint_restore, failure_detection, restart_gap, custom_badput_events, "
    "other); every attempt of the run counted, mean over ranks.",
    L.IDENTITY,
    unit="seconds",
    labels=("bucket",),
    when=_GOODPUT_WHEN,
)
GOODPUT_WALL = Metric(
    "ddpmon_goodput_wall_seconds",
    G,
    "The run's wall-clock time from its first attempt's first process start to now.",
    L.IDENTITY,
    unit="seconds",
    when=_GOODPUT_WHEN,
)
GOODPUT_RATIO = Metric(
    "ddpmon_goodput_ratio",
    G,
    "Productive step time (steps whose progress was kept) over the wall-clock time.",
    L.IDENTITY,
    unit="ratio",
    when=_GOODPUT_WHEN,
)
GOODPUT_ETTR = Metric(
    "ddpmon_goodput_ettr_ratio",
    G,
    "ETTR-compatible ratio (Kokolis et al. 2025): productive runtime (kept steps, their data "
    "wait and warm-up, marked phases) over the wall-clock time.",
    L.IDENTITY,
    unit="ratio",
    when=_GOODPUT_WHEN,
)


# -- FLOPs and MFU (per rank; docs/goodput.md, MFU) -----------------------------------------
_MFU_WHEN = "with FLOPs per step (counted on an early step, or given), after a step since"
FLOPS_PER_STEP = Metric(
    "ddpmon_flops_per_step", G,
    "FLOPs of one optimizer step on this rank (FlopCounterMode on one step, or given).",
    L.DATA_SUPPLY, when="after the counted step (flops_count_step, mon.count_flops) or given",
)
PEAK_FLOPS = Metric(
    "ddpmon_peak_flops", G,
    "Dense peak FLOP/s of this rank's device in the training dtype (the table, or peak_flops).",
    L.DATA_SUPPLY, when="with peak_flops, or a device and dtype the table knows",
)
TOKENS_PER_SECOND = Metric(
    "ddpmon_tokens_per_second", G,
    "Tokens (or samples) per second since the FLOPs or tokens were set: this rank's share of "
    "its batch (its tokens over the TP x PP ranks that train on it).",
    L.DATA_SUPPLY, when="with tokens per step (read from the counted step's batch, or given)",
)
ACHIEVED_FLOPS = Metric(
    "ddpmon_achieved_flops", G,
    "FLOP/s this rank achieved: FLOPs per step x steps per second.", L.DATA_SUPPLY,
    when=_MFU_WHEN,
)
MFU = Metric(
    "ddpmon_mfu_ratio", G,
    "Model FLOPs utilisation: achieved FLOP/s over the peak; a figure over 1 is never exported.",
    L.DATA_SUPPLY, unit="ratio", when=_MFU_WHEN + ", with a peak",
)


FIGURES: tuple[Metric, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Metric)
)
"""The run figures' series, in exposition order (the end of ``CATALOGUE``)."""
