"""Recording-rule names, ``level:metric:operations``: one constant each, imported by the rules,
the alerts and the dashboards.

``rank:`` records are per rank and keep every target label (job, instance, namespace, cluster,
node, run, rank...). ``run:`` records aggregate the ranks of a run and keep the run's labels
(``MixinConfig.run_labels``: cluster, namespace, job, run). Rates and means are over
``MixinConfig.rate_window`` (default 5m), which the names do not repeat because it is
configurable.
"""

# --- per rank ---
STEP_P99 = "rank:ddpmon_step_duration_seconds:p99"
STEPS_RATE = "rank:ddpmon_steps:rate"
DATA_WAIT_MEAN = "rank:ddpmon_data_wait_seconds:mean"
DATA_WAIT_RATIO = "rank:ddpmon_data_wait_seconds:iteration_ratio"
"""Data wait over (data wait + step time): the share of each iteration spent waiting for data."""
COLLECTIVE_MEAN = "rank:ddpmon_collective_duration_seconds:mean"
"""Mean time of one collective, per rank and ``op`` (exact: ``_sum / _count``)."""
COLLECTIVE_P99 = "rank:ddpmon_collective_duration_seconds:p99"
"""Per rank and ``op``, from factor-8 buckets: orders of magnitude, not fine differences."""
OWN_MEAN = "rank:ddpmon_step_own_seconds:mean"
"""Step time and data wait less the wait inside collectives, per step: the rank's own work
(``ddpmon.mixin.stragglers``)."""
OWN_BY_CAUSE = "rank:ddpmon_step_own_seconds:mean_by_cause"
"""The own time per step by ``cause``: data, compute, communication (from the raw series) and host
(the rest of the own time, recorded by a second rule after the first)."""
STRAGGLER_SLOWDOWN = "rank:ddpmon_straggler:slowdown"
"""Own time over the run's median rank's, less one (0.15: 15 % slower)."""
STRAGGLER_CAUSE = "rank:ddpmon_straggler:cause"
"""One series per rank, its ``cause`` the part furthest above the median rank's (value: the
excess, seconds per step)."""
SKIPPED_RATIO = "rank:ddpmon_amp_skipped_steps:ratio"
GRAD_UNABSORBED = "rank:ddpmon_grad_nonfinite_unabsorbed_steps:total"
"""Non-finite steps minus those the GradScaler absorbed (skipped); a counter."""
LOSS_UNABSORBED = "rank:ddpmon_loss_nonfinite_unabsorbed:total"
"""Non-finite losses minus skipped steps; grows only for a non-finite loss no scaler absorbed."""
HEARTBEAT_AGE = "rank:ddpmon_heartbeat_age_seconds:max"
"""Seconds since the rank's last completed step (attach time before the first)."""
STALL_THRESHOLD = "rank:ddpmon_stall_threshold_seconds:max"
"""The agent's exported stall threshold, or ``MixinConfig.stall_seconds`` where it exports none."""
GPU_ALLOCATED_RATIO = "rank:ddpmon_cuda_memory_allocated_bytes:device_ratio"
"""Highest allocator-allocated bytes (tensors) over the window, over the device's NVML total."""

# --- per run ---
STEP_LEADER = "run:ddpmon_step:max"
DATA_WAIT_RUN_MEDIAN = "run:ddpmon_data_wait_seconds:median"
COLLECTIVE_RUN_P99 = "run:ddpmon_collective_duration_seconds:p99"
"""Per run and ``op``."""
GRAD_NORM_RUN_MAX = "run:ddpmon_grad_norm:max_finite"
GRAD_NORM_RUN_SPREAD = "run:ddpmon_grad_norm:relative_spread"
RANKS_REPORTING = "run:ddpmon_ranks_reporting:count"
# What the straggler records compare a rank with, per run and pipeline stage (``stage`` absent
# outside pipelines): recorded once per evaluation so the per-rank records read a few series.
OWN_REFERENCE = "run:ddpmon_step_own_seconds:reference"
"""The median rank's own time per step (the smaller rank's in a group of 2)."""
OWN_MEDIAN_BY_CAUSE = "run:ddpmon_step_own_seconds:median_by_cause"
"""Per ``cause``: the median rank's own time per step in that cause."""
# Run-wide medians and minima the dashboards draw as one line: computed by the ruler that sees
# the whole run, so a panel reads one series per run instead of aggregating every rank's.
LOSS_RUN_MEDIAN = "run:ddpmon_loss:median"
LOCAL_NORM_RUN_MEDIAN = "run:ddpmon_grad_local_norm:median"
STEP_RUN_MIN = "run:ddpmon_step:min"
STEPS_RATE_RUN_MEDIAN = "run:ddpmon_steps:rate_median"
STEP_P99_RUN_MEDIAN = "run:ddpmon_step_duration_seconds:p99_median"
# Per run and op: the median rank's mean and p99 time per collective.
COLLECTIVE_MEAN_RUN_MEDIAN = "run:ddpmon_collective_duration_seconds:mean_median"
COLLECTIVE_P99_RUN_MEDIAN = "run:ddpmon_collective_duration_seconds:p99_median"
RSS_RUN_MEDIAN = "run:ddpmon_process_resident_memory_bytes:median"
# How many of the run's ranks have a per-rank value at or below each ``le`` (cumulative, like a
# histogram's buckets): the distributions "across ranks" read these few series per run.
DATA_WAIT_RANKS = "run:ddpmon_data_wait_seconds:mean_ranks_bucket"
STEP_P99_RANKS = "run:ddpmon_step_duration_seconds:p99_ranks_bucket"
# Per run and op (one set of buckets per op the run issues).
COLLECTIVE_MEAN_RANKS = "run:ddpmon_collective_duration_seconds:mean_ranks_bucket"
COLLECTIVE_P99_RANKS = "run:ddpmon_collective_duration_seconds:p99_ranks_bucket"
RANK_PROBLEMS = "run:ddpmon_rank_problems:count"
"""Per rank (its target labels kept), how many of the rank-health table's problems hold: down,
stalled, behind, straggler, starved, memory. ``run:`` because it compares the rank with its run
(leader, median compute time), so it runs where the whole run is seen, not on a shard."""
WORLD_SIZE = "run:ddpmon_world_size:max"
# The run's throughput: its ranks' figures added up by the ruler, which sees every rank
# (rank 0 sees only its own rate without a collective); docs/goodput.md, MFU.
TOKENS_RUN_RATE = "run:ddpmon_tokens_per_second:sum"
ACHIEVED_FLOPS_RUN = "run:ddpmon_achieved_flops:sum"
MFU_RUN = "run:ddpmon_mfu_ratio:flops_weighted"
"""The run's achieved FLOP/s over its peak, over the ranks whose MFU is exported (a refused,
impossible figure stays out of both sums): at most 1 as each rank's is."""
