"""Every event ``kind`` ddpmon writes to ``events.rank<R>.jsonl``, with its fields, declared once.

Why a catalogue: the event log is a contract (``ddpmon timeline``, the daemon's first-failure
reader and users' own scripts parse it), yet its writers are spread over the agent, the crash
hooks and the checkpoint observer. The reference page ``docs/reference/events.md`` is generated
from this table, and a test scans the source for every ``emit("<kind>", ...)`` call, so a new
kind or field cannot appear without being declared here.

Every event also carries the common fields of :data:`COMMON_FIELDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COMMON_FIELDS", "EVENT_KINDS", "EventKind", "by_name"]

COMMON_FIELDS: dict[str, str] = {
    "ts": "`time.time()` of this rank; add the `start` event's `clock_offset_seconds` for "
    "rank 0's clock",
    "rank": "global rank of the writer",
    "step": "optimizer step the event belongs to (`null` when not tied to a step)",
    "kind": "one of the kinds below",
    "attempt": "restart attempt (0 for the first); see Checkpoints and restarts",
}
"""Fields of every event."""


@dataclass(frozen=True, slots=True)
class EventKind:
    name: str
    meaning: str
    fields: dict[str, str] = field(default_factory=dict)
    """Field -> meaning; a field may be absent when it does not apply."""
    failure: bool = False
    """True when ``ddpmon timeline`` may pick this kind as a first failure."""


EVENT_KINDS: tuple[EventKind, ...] = (
    EventKind(
        "start",
        "The agent attached on this rank.",
        {
            "run_id": "the run id all ranks agreed on",
            "world_size": "ranks in the job",
            "local_rank": "rank on this node",
            "node": "node name label",
            "pid": "process id",
            "device": "the rank's device (`cpu`, `cuda:0`)",
            "port": "the /metrics port (null: no endpoint)",
            "strategy": "detected parallelism (`plain`, `ddp`, `fsdp2`, ...)",
            "clock_offset_seconds": "rank 0's clock minus this rank's, measured at attach",
            "clock_rtt_seconds": "width of the narrowest measurement round (uncertainty x2)",
            "attempt_source": "where the attempt number came from (`torchelastic`, `run_dir`: "
            "the starts before this one, or `slurm`: `SLURM_RESTART_COUNT`, a requeue)",
            "previous_progress": "last step the previous attempt of this rank completed",
            "process_start_ts": "when the process started (this rank's clock): goodput's "
            "initialisation runs from here to the first step",
        },
    ),
    EventKind(
        "nonfinite",
        "NaN/Inf in this rank's gradients (or loss) at a step.",
        {
            "param": "first non-finite parameter (original FQN)",
            "tensor": "`loss` when the loss itself was non-finite",
            "nonfinite": "`nan` or `inf`",
            "origin": "true when this rank's *local* gradients were non-finite first",
            "poisoned": "true when only an earlier applied non-finite step caused it",
            "grad_local_norm": "this rank's local norm at that step",
            "skipped_by": "who skipped the step (`scaler`, `engine`, `policy`, `loop`), if anyone",
            "action": "`skip` or `raise` under `on_nonfinite`",
            "stage": "pipeline parallel: the origin stage (on an origin step)",
            "microbatch": "pipeline parallel: the micro-batch where it started (null: a "
            "parameter gradient, summed over micro-batches)",
            "site": "pipeline parallel: `activation`, `output`, `activation_grad` or `param_grad`",
            "entry": "tensor parallel: the block nearest the loss whose output gradient was "
            "non-finite on this rank (where the NaN entered it)",
            "entry_depth": "tensor parallel: that block's place from the loss end (0: the last "
            "block); the timeline names the rank with the smallest",
            "where": "`reduced` when only the reduced gradients of the step in flight were seen "
            "non-finite",
            "running": "true for the step in flight when an exception left the loop (it never "
            "completed; `step` is the step that was running)",
            "phase": "the step in flight's phase (`before its forward`, `in forward or "
            "backward`, `after backward`, `in the optimizer step`)",
        },
        failure=True,
    ),
    EventKind(
        "rerun",
        "Under `on_nonfinite='rerun'`, a step was run once more on the same batch and RNG state "
        "(every rank reruns together) to tell a transient fault from a deterministic one.",
        {
            "trigger": "`nonfinite` (reduced gradients) or `norm_jump` (`rerun_norm_jump`)",
            "fault": "`transient` (did not reproduce: suspect the device) or `deterministic` "
            "(reproduced: the data or the numerics)",
            "origin": "true on the rank whose local gradients were bad (the suspect)",
            "action": "`skip` (transient), `raise` (deterministic non-finite), `apply` (a "
            "norm jump that reproduced) or `replace` (DeepSpeed, transient: the engine stepped "
            "with the rerun's gradients)",
            "device": "this rank's device",
            "gpu_uuid": "its GPU UUID, to compare with DCGM (null off CUDA)",
            "param": "first non-finite parameter of this rank's local gradients",
            "grad_norm": "the first run's global norm",
            "rerun_grad_norm": "the rerun's",
            "batch": "shapes and dtypes of the batch's tensors (never their values)",
            "sample_ids": "the step's sample ids from `mon.observe_samples` (first 64)",
            "sample_count": "how many sample ids the step had",
        },
        failure=True,
    ),
    EventKind(
        "overflow",
        "The GradScaler skipped the step (inf/NaN it absorbed).",
        {"loss_scale": "the scale at that step", "absorbed": "always true"},
    ),
    EventKind(
        "loss_spike",
        "The loss or the global gradient norm jumped above its robust rolling baseline "
        "(docs/loss-spikes.md). `step` is the onset: the earlier of the detection and the jump "
        "of the group that led.",
        {
            "signal": "`loss` or `grad_norm`: what spiked",
            "value": "its value at the detection",
            "baseline": "the baseline's median",
            "limit": "the limit it exceeded (median + max(threshold x 1.4826 x MAD, "
            "(min_ratio - 1) x median))",
            "detected_step": "the step whose value exceeded the limit",
            "group": "the module group whose update/weight ratio or gradient norm jumped first "
            "(absent: none jumped in the lookback)",
            "group_signal": "`update_ratio` or `grad_norm`: which of the group's figures jumped",
            "group_step": "the step of that jump",
            "group_factor": "the jump as a multiple of the group's baseline median",
            "sample_ids": "the detected step's sample ids (`observe_samples`), up to 64",
        },
    ),
    EventKind(
        "loss_spike_unrecovered",
        "A loss spike stayed above its limit for `spike_recover_steps` steps: "
        "`ddpmon_loss_spike_unrecovered_step` is set and DdpmonLossSpike pages.",
        {"signal": "what spiked", "steps": "steps since the detection",
         "limit": "the limit it stays above"},
    ),
    EventKind(
        "loss_spike_recovered",
        "A loss spike fell back under its limit.",
        {"signal": "what spiked", "recovered_step": "the first step back under the limit",
         "steps": "steps from the detection to the recovery"},
    ),
    EventKind(
        "scale_floor",
        "The loss scale reached `loss_scale_floor`.",
        {"loss_scale": "the scale", "floor": "the configured floor"},
        failure=True,
    ),
    EventKind(
        "loss_scale_floor",
        "The loss-scale floor policy acted: `loss_scale_floor_steps` consecutive steps at or "
        "below `loss_scale_floor` (`source=ddpmon`), or DeepSpeed's scaler raised at its own "
        "minimum scale (`source=deepspeed`). With `action=raise` every rank raises "
        "`ddpmon.LossScaleFloorError` with the same `message` right after.",
        {
            "action": "`record` (training goes on) or `raise`",
            "source": "`ddpmon` (the floor policy) or `deepspeed` (DeepSpeed's own exception)",
            "loss_scale": "the scale after the step",
            "floor": "`loss_scale_floor`",
            "steps": "`loss_scale_floor_steps`",
            "origin_steps": "recent steps at which this rank's local gradients were non-finite",
            "origin_ranks": "ranks whose local gradients were the overflows' origin (`raise`)",
            "checkpoint": "last good checkpoint save (`step`, `path`), or null",
            "message": "the exception's message (`raise`; DeepSpeed's own for `source=deepspeed`)",
        },
        failure=True,
    ),
    EventKind("step_skipped", "The loop skipped the optimizer step.", {"by": "`loop`"}),
    EventKind(
        "identical_data",
        "Another rank's local gradients were bit-identical to this rank's (duplicated shard).",
        {"other_ranks": "the ranks with identical gradients"},
    ),
    EventKind(
        "replica_mismatch",
        "This rank's parameters differed, bit for bit, from its data-parallel replicas' majority "
        "at a replica check (`replica_check_every`): silent data corruption, a step skipped on "
        "this rank only, a non-deterministic kernel or another checkpoint.",
        {
            "ranks": "every rank of the replica group that differed from the majority (all of "
            "them when there is none, as with two replicas)",
            "group": "the first parameter group whose checksum differs",
            "replicas": "ranks in the replica group",
            "device": "this rank's device; its GPU UUID is `ddpmon_rank_info{gpu_uuid}`",
            "first_check": "the first check of this process (a resume): the weights were loaded "
            "different, not computed different",
        },
        failure=True,
    ),
    EventKind(
        "grad_norm_mismatch",
        "The norm the trainer reported differs from ddpmon's beyond `grad_norm_tolerance`.",
        {"grad_norm": "ddpmon's norm", "trainer_grad_norm": "the trainer's"},
    ),
    EventKind(
        "stall",
        "No step completed for `stall_seconds` (once per stall episode).",
        {"idle_seconds": "seconds since the last step", "stall_seconds": "the threshold",
         "phase": "the rank's phase (docs/slow-and-stuck/hangs.md)",
         "frame": "its training thread's innermost frame in user code",
         "collective": "the oldest collective not completed: `{op, group, seq}`",
         "sequences": "each process group's last issued collective sequence number"},
        failure=True,
    ),
    EventKind(
        "write_gap",
        "Writes to the run dir failed (a full disk, a quota, a read-only mount) and now work "
        "again; recorded once per episode, at the first write that works. Its `step` is "
        "`last_step`.",
        {
            "since_ts": "when the first write failed",
            "seconds": "how long writes failed",
            "first_step": "first step whose writes failed",
            "last_step": "last step whose writes failed",
            "failures": "failed writes per writer (`eventlog`, `history`, `evidence`, ...)",
            "lost": "items lost for good per writer (event lines, bundles, history rows)",
            "resumed_by": "the writer whose write worked first",
            "error": "the first error",
            "detail": "one line: how long, which steps, what was lost",
        },
    ),
    EventKind(
        "checkpoint_save",
        "A checkpoint save ended (`ok=false`: it failed and is not a checkpoint).",
        {
            "ok": "true when the save completed",
            "path": "the checkpoint path",
            "seconds": "time spent",
            "bytes": "size on disk",
            "source": "`explicit` (observe_checkpoint) or `dcp.save`/`dcp.async_save`",
            "contains": "states the save said it holds",
            "async_write": "true for `async_save` (only staging is timed)",
            "error": "the exception, when `ok=false`",
        },
    ),
    EventKind(
        "checkpoint_load",
        "A checkpoint load (a resume) ended.",
        {
            "ok": "true when the load completed",
            "path": "the checkpoint path",
            "seconds": "time spent",
            "source": "`explicit` or `dcp.load`",
            "resume_step": "the step the resumed run starts at",
            "restored": "states restored",
            "not_restored": "states said not restored",
            "not_stated": "states nobody said anything about",
            "absent": "states this run does not have (no GradScaler: no scaler)",
            "error": "the exception, when `ok=false`",
        },
    ),
    EventKind(
        "phase",
        "A phase the script marked ended (`with mon.phase(\"eval\"):`); goodput counts it as "
        "`custom_badput_events`.",
        {
            "name": "the phase's name",
            "seconds": "how long it took",
            "ok": "false when an exception left it",
        },
    ),
    EventKind(
        "exit",
        "The rank ended: `close()`, a normal exit, an uncaught exception or Ctrl-C.",
        {
            "reason": "`close`, `normal`, `exception` or `keyboard_interrupt`",
            "code": "exit code",
            "steps": "steps completed (at `close`)",
            "exc_type": "exception class, for `reason=exception`",
            "message": "exception message (2,000 characters at most)",
            "traceback": "formatted traceback (last 20,000 characters)",
            "running": "true when an exception left a step in flight: `step` is that step (not "
            "a completed one)",
            "phase": "that step's phase (as for `nonfinite`)",
            "loss": "that step's loss, when one was observed (`observe_loss`, an integration)",
        },
        failure=True,
    ),
    EventKind(
        "thread_exception",
        "An uncaught exception in another thread of the rank.",
        {
            "thread": "thread name",
            "exc_type": "exception class",
            "message": "exception message",
            "traceback": "formatted traceback",
        },
    ),
)

_BY_NAME = {k.name: k for k in EVENT_KINDS}


def by_name(name: str) -> EventKind | None:
    return _BY_NAME.get(name)
