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

from typing import Any

from .metric_types import BASE_LABELS, Layer, Metric, MetricType

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
    "Step time by part, summed over steps: compute (forward, backward, optimizer) and wait "
    "(inside collectives, for the other ranks); the step's host time is the step time's sum "
    "less both. The slow rank computes most and waits least.",
    L.DATA_SUPPLY,
    unit="seconds",
    labels=("part",),
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

# -- memory (live sources, read at scrape time) --------------------------------------------
_ALLOC = "with the CUDA allocator"
CUDA_MEMORY_ALLOCATED = Metric(
    "ddpmon_cuda_memory_allocated_bytes",
    G,
    "Allocator: bytes in tensors.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_MEMORY_RESERVED = Metric(
    "ddpmon_cuda_memory_reserved_bytes",
    G,
    "Allocator: bytes reserved.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_MEMORY_PEAK_ALLOCATED = Metric(
    "ddpmon_cuda_memory_peak_allocated_bytes",
    G,
    "Allocator: peak bytes in tensors.",
    L.MEMORY,
    unit="bytes",
    when=_ALLOC,
)
CUDA_ALLOC_RETRIES = Metric(
    "ddpmon_cuda_alloc_retries_total", C, "Allocator retries.", L.MEMORY, when=_ALLOC
)
CUDA_OOMS = Metric(
    "ddpmon_cuda_ooms_total", C, "Allocator out-of-memory errors.", L.MEMORY, when=_ALLOC
)
_NVML = "with NVML"
GPU_MEMORY_USED = Metric(
    "ddpmon_gpu_memory_used_bytes",
    G,
    "NVML: device memory used.",
    L.MEMORY,
    unit="bytes",
    labels=("gpu",),
    when=_NVML,
)
GPU_MEMORY_TOTAL = Metric(
    "ddpmon_gpu_memory_total_bytes",
    G,
    "NVML: device memory total.",
    L.MEMORY,
    unit="bytes",
    labels=("gpu",),
    when=_NVML,
)
GPU_UTILIZATION = Metric(
    "ddpmon_gpu_utilization_ratio",
    G,
    "NVML: GPU utilisation 0-1.",
    L.MEMORY,
    unit="ratio",
    labels=("gpu",),
    when=_NVML,
)
GPU_TEMPERATURE = Metric(
    "ddpmon_gpu_temperature_celsius",
    G,
    "NVML: GPU temperature.",
    L.MEMORY,
    unit="celsius",
    labels=("gpu",),
    when=_NVML,
)
GPU_POWER = Metric(
    "ddpmon_gpu_power_watts",
    G,
    "NVML: power draw.",
    L.MEMORY,
    unit="watts",
    labels=("gpu",),
    when=_NVML,
)
PROCESS_RESIDENT_MEMORY = Metric(
    "ddpmon_process_resident_memory_bytes",
    G,
    "Resident memory of this rank's process.",
    L.MEMORY,
    unit="bytes",
    when="with psutil",
)
PROCESS_CPU_SECONDS = Metric(
    "ddpmon_process_cpu_seconds_total",
    C,
    "CPU time of this rank's process.",
    L.MEMORY,
    unit="seconds",
    when="with psutil",
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
_MFU_WHEN = "with FLOPs per step (mon.count_flops or flops_per_step), after a step since"
FLOPS_PER_STEP = Metric(
    "ddpmon_flops_per_step", G,
    "FLOPs of one optimizer step on this rank (FlopCounterMode on one step, or given).",
    L.DATA_SUPPLY, when="after mon.count_flops or with flops_per_step",
)
PEAK_FLOPS = Metric(
    "ddpmon_peak_flops", G,
    "Dense peak FLOP/s of this rank's device in the training dtype (the table, or peak_flops).",
    L.DATA_SUPPLY, when="with peak_flops, or a device and dtype the table knows",
)
TOKENS_PER_SECOND = Metric(
    "ddpmon_tokens_per_second", G,
    "Tokens (or samples) this rank processes per second since the FLOPs or tokens were set.",
    L.DATA_SUPPLY, when="with tokens_per_step, after a step",
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


CATALOGUE: tuple[Metric, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Metric)
)
"""Every metric, in exposition order."""

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE}

# -- the node daemon's own series (ddpmon/daemon/node.py) -----------------------------------
# One per node, without run or rank, so after CATALOGUE (a rank's series). The daemon also
# serves GPU_* and COLLECTOR_SUCCESS above, with their extra labels only.
_NODE, _HOST = "from the node daemon", "from the node daemon, through psutil"


def _node(name: str, kind: MetricType, help_: str, layer: Layer, **more: Any) -> Metric:
    return Metric(name, kind, help_, layer, base_labels=(), **{"when": _NODE, **more})


NODE_GPUS = _node("ddpmon_node_gpus", G, "GPUs NVML reports on this node.", L.IDENTITY)
NODE_GPU_INFO = _node("ddpmon_node_gpu_info", G, "GPU identity (value 1).", L.IDENTITY,
                      labels=("gpu", "gpu_uuid", "name", "pci_bus_id"))
GPU_ECC_UNCORRECTED = _node(
    "ddpmon_gpu_ecc_uncorrected_errors_total", C,
    "Uncorrected ECC errors since boot (NVML, aggregate), where supported.", L.MEMORY,
    labels=("gpu",),
)
NODE_INFO = _node("ddpmon_node_info", G, "This node (value 1).", L.IDENTITY, labels=("node",))
NODE_CPU_SECONDS = _node("ddpmon_node_cpu_seconds_total", C, "CPU time of the host by mode.",
                         L.IDENTITY, unit="seconds", labels=("mode",), when=_HOST)
NODE_CPUS = _node("ddpmon_node_cpus", G, "Logical CPUs of the host.", L.IDENTITY, when=_HOST)
NODE_LOAD1 = _node("ddpmon_node_load1", G, "1-minute load average.", L.IDENTITY, when=_HOST)
NODE_MEMORY_TOTAL = _node("ddpmon_node_memory_total_bytes", G, "Host memory size.", L.MEMORY,
                          unit="bytes", when=_HOST)
NODE_MEMORY_AVAILABLE = _node("ddpmon_node_memory_available_bytes", G, "Host memory available.",
                              L.MEMORY, unit="bytes", when=_HOST)
NODE_DISK_TOTAL = _node("ddpmon_node_disk_total_bytes", G, "Filesystem size.", L.IDENTITY,
                        unit="bytes", labels=("path",), when=_HOST)
NODE_DISK_FREE = _node("ddpmon_node_disk_free_bytes", G, "Filesystem space free.", L.IDENTITY,
                       unit="bytes", labels=("path",), when=_HOST)
NODE_NETWORK_RECEIVE = _node("ddpmon_node_network_receive_bytes_total", C,
                             "Bytes received per interface.", L.COMMUNICATION, unit="bytes",
                             labels=("device",), when=_HOST)
NODE_NETWORK_TRANSMIT = _node("ddpmon_node_network_transmit_bytes_total", C,
                              "Bytes sent per interface.", L.COMMUNICATION, unit="bytes",
                              labels=("device",), when=_HOST)
DAEMON_JOBS = _node("ddpmon_daemon_jobs", G, "Jobs known to the daemon by state.", L.IDENTITY,
                    labels=("state",))
DAEMON_REGISTERED_RANKS = _node("ddpmon_daemon_registered_ranks", G, "Live ranks listed by /sd.",
                                L.IDENTITY)
COLLECTOR_DURATION = _node("ddpmon_collector_duration_seconds", G,
                           "Time spent reading the source.", L.IDENTITY, unit="seconds",
                           labels=("collector",))

NODE_CATALOGUE: tuple[Metric, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Metric) and v not in CATALOGUE
)
"""The node daemon's own series, in exposition order (it serves GPU_* and COLLECTOR_SUCCESS
of CATALOGUE too)."""


def by_layer(layer: Layer) -> tuple[Metric, ...]:
    return tuple(m for m in CATALOGUE if m.layer is layer)


__all__ += [name for name, v in list(globals().items()) if isinstance(v, Metric)]
del G, C, H, L
