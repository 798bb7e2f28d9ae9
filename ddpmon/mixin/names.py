"""Recording-rule names: one constant each, imported by the rules, the alerts and the dashboards.

Per-rank records keep every target label (``run``, ``rank``, ``job``, ``instance``...); run-wide
records (``run_`` in the operation) keep ``run`` (and ``quantile`` where stated).
"""

STEP_MEAN = "ddpmon:step_duration_seconds:mean"
STEP_P99 = "ddpmon:step_duration_seconds:p99"
STEP_RUN_QUANTILE = "ddpmon:step_duration_seconds:run_quantile"
STEPS_RATE = "ddpmon:steps:rate"
DATA_WAIT_MEAN = "ddpmon:data_wait_seconds:mean"
ALLREDUCE_PER_STEP = "ddpmon:allreduce_duration_seconds:per_step"
ALLREDUCE_P50 = "ddpmon:allreduce_duration_seconds:p50"
ALLREDUCE_P99 = "ddpmon:allreduce_duration_seconds:p99"
ALLREDUCE_RUN_P99 = "ddpmon:allreduce_duration_seconds:run_p99"
COMPUTE_MEAN = "ddpmon:step_compute_seconds:mean"
COMPUTE_RUN_MEDIAN = "ddpmon:step_compute_seconds:run_median"
SKIPPED_RATIO = "ddpmon:amp_skipped_steps:ratio"
GRAD_NORM_RUN_MAX = "ddpmon:grad_norm:run_max_finite"
GRAD_NORM_RUN_SPREAD = "ddpmon:grad_norm:run_relative_spread"
RANKS_REPORTING = "ddpmon:ranks:run_reporting"
WORLD_SIZE = "ddpmon:world_size:run_max"
GPU_MEMORY_RATIO = "ddpmon:gpu_memory_used:ratio"
