"""The metric catalogue: every series a rank exposes, declared once.

The collector builds its families from these entries (name, type, help, unit, labels), and
``ddpmon top``, the demo, the daemon's job summary, the README table and the mixin read names and
layers from here, so a rename is one edit and a test catches any consumer that drifts.

Usage: ``from ddpmon import metrics; metrics.GRAD_NORM.name``. Every series also carries the
``run`` and ``rank`` labels (``BASE_LABELS``); ``Metric.labels`` lists only the extra ones.
Names are the exposed ones: counters end in ``_total``, histograms are the family name (their
samples add ``_bucket``, ``_count`` and ``_sum``).
"""

from __future__ import annotations

# the parts' entries are names of this module too (metrics.MFU, metrics.NODE_GPUS)
from .figures import (
    ACHIEVED_FLOPS,
    FIGURES,
    FLOPS_PER_STEP,
    GOODPUT_ETTR,
    GOODPUT_RATIO,
    GOODPUT_SECONDS,
    GOODPUT_WALL,
    MFU,
    PEAK_FLOPS,
    TOKENS_PER_SECOND,
)
from .memory import (
    CUDA_ALLOC_RETRIES,
    CUDA_MEMORY_ALLOCATED,
    CUDA_MEMORY_PEAK_ALLOCATED,
    CUDA_MEMORY_RESERVED,
    CUDA_OOMS,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    MEMORY,
    PROCESS_CPU_SECONDS,
    PROCESS_RESIDENT_MEMORY,
)
from .node import (
    COLLECTOR_DURATION,
    DAEMON_JOBS,
    DAEMON_REGISTERED_RANKS,
    GPU_ECC_UNCORRECTED,
    NODE_CATALOGUE,
    NODE_CPU_SECONDS,
    NODE_CPUS,
    NODE_DISK_FREE,
    NODE_DISK_TOTAL,
    NODE_GPU_INFO,
    NODE_GPUS,
    NODE_INFO,
    NODE_LOAD1,
    NODE_MEMORY_AVAILABLE,
    NODE_MEMORY_TOTAL,
    NODE_NETWORK_RECEIVE,
    NODE_NETWORK_TRANSMIT,
)
from .types import BASE_LABELS, Layer, Metric, MetricType

__all__ = [
    "BASE_LABELS",
    "COLLECTIVE_OPS",
    "BY_NAME",
    "CATALOGUE",
    "Layer",
    "Metric",
    "MetricType",
    "by_layer",
]


G, C, H = MetricType.GAUGE, MetricType.COUNTER, MetricType.HISTOGRAM
L = Layer

# -- identity / health ---------------------------------------------------------------------
RANK_INFO = Metric(
    "ddpmon_rank_info",
    G,
    "Identity of this rank; join with DCGM series on gpu_uuid. precision: what the model "
    "trains in, fp32, bf16, fp16, fp64 or other (FSDP2's param_dtype, else the parameters' "
    "dtype), amp-<dtype> under autocast (from the first forward on), a +gradscaler suffix with "
    "an enabled GradScaler, or deepspeed-<fp32|bf16|fp16>.",
    L.IDENTITY,
    labels=("local_rank", "world_size", "node", "backend", "device", "gpu_uuid", "pid", "strategy",
            "precision"),
)
BUILD_INFO = Metric(
    "ddpmon_build_info",
    G,
    "Versions of ddpmon and its stack.",
    L.IDENTITY,
    labels=("version", "torch_version", "cuda_version", "nccl_version", "python_version"),
)
WORLD_SIZE = Metric("ddpmon_world_size", G, "Number of ranks the job expects.", L.IDENTITY)

# -- data supply ---------------------------------------------------------------------------
STEP = Metric("ddpmon_step", G, "Index of the last completed step.", L.DATA_SUPPLY)
STEPS = Metric("ddpmon_steps_total", C, "Steps completed, skipped ones included.", L.DATA_SUPPLY)
LAST_STEP_TIMESTAMP = Metric(
    "ddpmon_last_step_timestamp_seconds",
    G,
    "Wall time of the last completed step (attach time before the first).",
    L.DATA_SUPPLY,
    unit="seconds",
)
STALL_THRESHOLD = Metric(
    "ddpmon_stall_threshold_seconds",
    G,
    "Configured stall_seconds: no completed step for this long is a stall; alerts compare "
    "against it.",
    L.DATA_SUPPLY,
    unit="seconds",
    when="when the agent sets it",
)
STEP_DURATION = Metric(
    "ddpmon_step_duration_seconds", H, "Step wall time.", L.DATA_SUPPLY, unit="seconds"
)
DATA_WAIT = Metric(
    "ddpmon_data_wait_seconds",
    H,
    "Time from a step's end to the next step's start.",
    L.DATA_SUPPLY,
    unit="seconds",
)
STEP_PART_SECONDS = Metric(
    "ddpmon_step_part_seconds_total",
    C,
    "Step time by part, summed over steps: compute (forward, backward, optimizer), wait "
    "(inside collectives, for the other ranks) and communication (issuing its own "
    "collectives); the step's host time is the step time's sum less the three. The slow rank "
    "computes (or issues) most and waits least. Under pipeline parallel, stage: the stages the "
    "rank runs (empty elsewhere), so it is compared within its stage.",
    L.DATA_SUPPLY,
    unit="seconds",
    labels=("part", "stage"),
    when="after a first timed step, on a rank issuing at most 3 collective ops (series budget)",
)
DATA_IDENTICAL_BATCHES = Metric(
    "ddpmon_data_identical_batches_total",
    C,
    "Sampled steps where another rank's local gradients were bit-identical to this rank's: "
    "duplicated data shards.",
    L.DATA_SUPPLY,
)

# -- numerics ------------------------------------------------------------------------------
LOSS = Metric("ddpmon_loss", G, "Last observed loss.", L.NUMERICS, when="after the first loss")
LOSS_NONFINITE = Metric(
    "ddpmon_loss_nonfinite_total", C, "Non-finite losses observed.", L.NUMERICS
)
GRAD_NORM = Metric(
    "ddpmon_grad_norm",
    G,
    "Global L2 norm of unscaled gradients after reduction.",
    L.NUMERICS,
    when="after the first step",
)
GRAD_LOCAL_NORM = Metric(
    "ddpmon_grad_local_norm",
    G,
    "L2 norm of this rank's unscaled gradients before the all-reduce.",
    L.NUMERICS,
    when="after the first local measurement",
)
GRAD_GROUP_NORM = Metric(
    "ddpmon_grad_group_norm",
    G,
    "L2 norm of unscaled gradients per module group.",
    L.NUMERICS,
    labels=("group",),
    when="after the first step",
)
UPDATE_RATIO = Metric(
    "ddpmon_update_ratio",
    G,
    "Update/weight norm ratio ||dw||/||w|| per module group at the last sampled step.",
    L.NUMERICS,
    labels=("group",),
    when="opt-in (update_series=True), after the first sampled step",
)
LOGIT_MAX = Metric(
    "ddpmon_logit_max",
    G,
    "Largest output value of a logit module at the last step.",
    L.NUMERICS,
    labels=("module",),
    when="opt-in (logit_modules=[...]), after the first step",
)
LOSS_SPIKE_UNRECOVERED = Metric(
    "ddpmon_loss_spike_unrecovered_step",
    G,
    "Step of a loss or grad-norm spike on this rank that has not recovered within "
    "spike_recover_steps.",
    L.NUMERICS,
    when="while such a spike lasts",
)
GRAD_NONFINITE_STEPS = Metric(
    "ddpmon_grad_nonfinite_steps_total",
    C,
    "Steps whose reduced gradients held NaN or Inf.",
    L.NUMERICS,
)
GRAD_NONFINITE_ORIGIN_STEPS = Metric(
    "ddpmon_grad_nonfinite_origin_steps_total",
    C,
    "Steps where this rank's local gradients held NaN or Inf before the all-reduce.",
    L.NUMERICS,
)
GRAD_NONFINITE_POISONED_STEPS = Metric(
    "ddpmon_grad_nonfinite_poisoned_steps_total",
    C,
    "Steps whose local gradients were non-finite only because an earlier non-finite step had "
    "been applied to the weights (not an origin).",
    L.NUMERICS,
)
GRAD_NORM_MISMATCH = Metric(
    "ddpmon_grad_norm_mismatch_total",
    C,
    "Steps where the gradient norm the trainer reported differed from ddpmon's beyond the "
    "tolerance.",
    L.NUMERICS,
)
REPLICA_MISMATCH = Metric(
    "ddpmon_replica_mismatch_total",
    C,
    "Replica checks at which this rank's parameters differed, bit for bit, from its replica "
    "group's majority (silent data corruption, a step skipped on one rank, a non-deterministic "
    "kernel, another checkpoint).",
    L.NUMERICS,
    when="where the strategy has data-parallel replicas (DDP, HSDP, DeepSpeed ZeRO-0/1/2) and "
    "replica_check_every > 0",
)
STEP_RERUNS = Metric(
    "ddpmon_step_reruns_total",
    C,
    "Steps run twice on the same batch and RNG state (on_nonfinite='rerun'), by fault: "
    "transient (the fault did not reproduce: suspect the device) or deterministic (it did: the "
    "data or the numerics).",
    L.NUMERICS,
    labels=("fault",),
    when="with on_nonfinite='rerun', both faults from 0",
)
GRAD_FIRST_NONFINITE_INFO = Metric(
    "ddpmon_grad_first_nonfinite_info",
    G,
    "First local non-finite gradient seen on this rank.",
    L.NUMERICS,
    labels=("step", "param", "kind"),
    when="after the first local non-finite gradient",
)
AMP_LOSS_SCALE = Metric(
    "ddpmon_amp_loss_scale",
    G,
    "Current AMP loss scale.",
    L.NUMERICS,
    when="with a GradScaler or DeepSpeed fp16, after the first read",
)
AMP_LOSS_SCALE_FLOOR = Metric(
    "ddpmon_amp_loss_scale_floor",
    G,
    "Configured loss scale floor; alerts compare against it.",
    L.NUMERICS,
    when="with a GradScaler or DeepSpeed fp16",
)
STEPS_SKIPPED = Metric(
    "ddpmon_steps_skipped_total",
    C,
    "Optimizer steps skipped, by who skipped them: scaler (a GradScaler or DeepSpeed fp16 "
    "found Inf/NaN), engine (DeepSpeed's overflow check under bf16/fp32), loop (the loop did "
    "not call optimizer.step()), policy (on_nonfinite='skip', or 'rerun' on a transient fault).",
    L.NUMERICS,
    labels=("by",),
    when="by=loop with a torch optimizer, scaler with a loss scaler, engine under DeepSpeed "
    "bf16/fp32, policy with on_nonfinite='skip' or 'rerun'",
)
LEARNING_RATE = Metric(
    "ddpmon_learning_rate",
    G,
    "Learning rate of the optimizer's first parameter group at the step.",
    L.NUMERICS,
    when="opt-in (step_metrics=['learning_rate']), after the first step",
)


# -- communication -------------------------------------------------------------------------
COLLECTIVE_OPS = (
    "all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast", "send", "recv"
)
"""Every value of the ``op`` label, in exposition order (see ``ddpmon.probes.comm``)."""
_OPS = "for each op this rank has issued"
COLLECTIVE_DURATION = Metric(
    "ddpmon_collective_duration_seconds",
    H,
    "Time of one collective, issue to completion (wall time on CPU, device events on GPU).",
    L.COMMUNICATION,
    unit="seconds",
    labels=("op",),
    when=_OPS,
)
COLLECTIVE_BYTES = Metric(
    "ddpmon_collective_bytes_total",
    C,
    "Bytes passed to collectives (each call's input or bucket size).",
    L.COMMUNICATION,
    unit="bytes",
    labels=("op",),
    when=_OPS,
)

# -- what a rank is doing now (read at scrape time; docs/slow-and-stuck/hangs.md) -----------
PHASE_SINCE = Metric(
    "ddpmon_phase_since_timestamp_seconds",
    G,
    "Wall time the rank's current phase began. phase: data, forward_backward, after_backward, "
    "optimizer, checkpoint, or a name the loop gave mon.phase(); one series at a time.",
    L.COMMUNICATION,
    unit="seconds",
    labels=("phase",),
)
COLLECTIVE_SEQUENCE = Metric(
    "ddpmon_collective_sequence",
    G,
    "Sequence number of the last collective this rank issued on the process group (torch's "
    "flight recorder).",
    L.COMMUNICATION,
    labels=("group",),
    when="with torch's flight recorder, for each group this rank has used",
)
COLLECTIVE_INFLIGHT_SINCE = Metric(
    "ddpmon_collective_inflight_since_timestamp_seconds",
    G,
    "Wall time the oldest collective this rank has not completed on the group was issued.",
    L.COMMUNICATION,
    unit="seconds",
    labels=("group", "op"),
    when="while a collective is in flight at the scrape",
)
COLLECTIVE_INFLIGHT_SEQUENCE = Metric(
    "ddpmon_collective_inflight_sequence",
    G,
    "Sequence number of the oldest collective this rank has not completed on the group.",
    L.COMMUNICATION,
    labels=("group", "op"),
    when="while a collective is in flight at the scrape",
)
STUCK = Metric(
    "ddpmon_stuck_seconds",
    G,
    "Seconds since the rank last made progress (a step, a phase, a collective), past "
    "hang_seconds; frame: its innermost frame in user code; quiet: 1 in a phase that may last "
    "(checkpoint, before the first step, a mon.phase()), where no hang is paged.",
    L.COMMUNICATION,
    unit="seconds",
    labels=("phase", "frame", "quiet"),
    when="after hang_seconds without progress",
)

# -- agent health --------------------------------------------------------------------------
COLLECTOR_SUCCESS = Metric(
    "ddpmon_collector_success",
    G,
    "1 when a live source was read, 0 when it failed or is absent.",
    L.IDENTITY,
    labels=("collector",),
    when="with live sources",
)
AGENT_ERRORS = Metric(
    "ddpmon_agent_errors_total",
    C,
    "Probe failures; training went on.",
    L.IDENTITY,
    labels=("probe",),
)

# -- checkpoints and restarts (ddpmon/agent/checkpoints.py) ---------------------------------
ATTEMPT = Metric(
    "ddpmon_attempt",
    G,
    "Restart attempt of this rank's process: 0 at first launch, N after N restarts "
    "(torchelastic's restart count, else the starts recorded in the run dir).",
    L.IDENTITY,
)
CHECKPOINT_LAST_STEP = Metric(
    "ddpmon_checkpoint_last_step",
    G,
    "Step of the last checkpoint saved (the step a resume from it starts at).",
    L.IDENTITY,
    when="after the first checkpoint save",
)
CHECKPOINT_LAST_TIMESTAMP = Metric(
    "ddpmon_checkpoint_last_timestamp_seconds",
    G,
    "Wall time the last checkpoint save completed.",
    L.IDENTITY,
    unit="seconds",
    when="after the first checkpoint save",
)
CHECKPOINT_DURATION = Metric(
    "ddpmon_checkpoint_duration_seconds",
    H,
    "Time this rank spent blocked in a checkpoint save or load.",
    L.IDENTITY,
    unit="seconds",
    labels=("kind",),
    when="after the first checkpoint save or load",
)
CHECKPOINT_SIZE = Metric(
    "ddpmon_checkpoint_size_bytes",
    G,
    "Size of the last checkpoint saved, on disk or as reported.",
    L.IDENTITY,
    unit="bytes",
    when="after a checkpoint save of known size",
)


# The memory layer, the run figures and the node daemon's series live in their own modules
# (memory.py, figures.py, node.py); their entries are names of this module too (``metrics.MFU``).
_HERE: tuple[Metric, ...] = tuple(
    v for v in list(globals().values())
    if isinstance(v, Metric) and v not in (*MEMORY, *FIGURES, *NODE_CATALOGUE)
)
_AGENT = _HERE.index(COLLECTOR_SUCCESS)  # the memory layer comes before the agent's health
CATALOGUE: tuple[Metric, ...] = (*_HERE[:_AGENT], *MEMORY, *_HERE[_AGENT:], *FIGURES)
"""Every metric of a rank, in exposition order."""

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE}


def by_layer(layer: Layer) -> tuple[Metric, ...]:
    return tuple(m for m in CATALOGUE if m.layer is layer)


__all__ += [name for name, v in list(globals().items()) if isinstance(v, Metric)]
del G, C, H, L
