"""Numerics alerts: loss scale, non-finite gradients and losses, norm spikes and desyncs.

A GradScaler absorbs overflows while it calibrates and whenever it probes a larger scale: the
step is skipped, the scale halves, training goes on. Those steps are counted
(``ddpmon_grad_nonfinite_steps_total``, ``ddpmon_amp_skipped_steps_total``, the dashboards'
"Skipped steps" annotation, ``overflow`` events) but do not page. DdpmonNonFiniteGradients and
DdpmonNonFiniteLoss page for what no scaler absorbed (no scaler, bf16, fp32,
``on_nonfinite=record``) and for non-finite steps that persist; a scaler that keeps skipping is
DdpmonLossScaleCollapsing, then DdpmonLossScaleAtFloor (which inhibits NonFiniteGradients).
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin import names as n
from ddpmon.mixin.alerts import RANK, RUN, Alert, rank_list
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.NUMERICS
BY_RUN = 'run="%s"'


def alerts(c: MixinConfig) -> list[Alert]:
    w, gw = c.nonfinite_window, c.gauge_window
    young = c.nonfinite_persistent_window

    def origins(o: str, by: str) -> str:
        # An origin counter that grew in the window, or one that was already non-zero at its
        # first scrape (the NaN came before Prometheus first scraped the rank; increase() sees
        # nothing there) and is younger than the persistent window.
        return (
            f"{by} (increase({o}[{w}])) > 0\n    or\n"
            f"    {by} ({o}) > 0 unless {by} ({o} offset {young})"
        )

    origin = origins(sel(c, m.GRAD_NONFINITE_ORIGIN_STEPS.name, BY_RUN), "sum by (rank)")
    unabsorbed = f"increase({n.GRAD_UNABSORBED}[{w}]) > 0"
    unabsorbed_late = f"increase({n.GRAD_UNABSORBED}[{w}] offset {c.nonfinite_origin_wait}) > 0"
    persistent = (
        f"increase({sel(c, m.GRAD_NONFINITE_STEPS.name)}[{c.nonfinite_persistent_window}])"
        f" > {c.nonfinite_persistent_steps}"
    )
    origin_sel = sel(c, m.GRAD_NONFINITE_ORIGIN_STEPS.name)
    largest_local = f"{sel(c, m.GRAD_LOCAL_NORM.name, BY_RUN)} < +Inf"
    return [
        Alert(
            "DdpmonLossScaleAtFloor", L, "critical",
            # last_over_time: a failed scrape does not reset the pending alert.
            f"last_over_time({sel(c, m.AMP_LOSS_SCALE.name)}[{gw}])\n<=\n"
            f"last_over_time({sel(c, m.AMP_LOSS_SCALE_FLOOR.name)}[{gw}])",
            c.loss_scale_floor_for,
            "The fp16 loss scale is at its floor; training has stopped making progress.",
            f"{RANK}: the loss scale (GradScaler or DeepSpeed's) is {{{{ $value }}}}, at or "
            "below the floor the agent was configured with (loss_scale_floor); every step "
            "overflows and is skipped. on_loss_scale_floor=\"raise\" stops the run instead.",
        ),
        Alert(
            "DdpmonLossScaleCollapsing", L, "warning",
            f"{n.SKIPPED_RATIO} > {c.loss_scale_collapse_ratio:g}",
            c.loss_scale_collapse_for,
            "Most optimizer steps are being skipped by the loss scaler (GradScaler or DeepSpeed).",
            f"{RANK}: {{{{ $value | humanizePercentage }}}} of the steps in the last "
            f"{c.rate_window} were skipped for inf/NaN gradients; the loss scale is collapsing.",
        ),
        Alert(
            "DdpmonNonFiniteGradients", L, "critical",
            # Steps no scaler absorbed. Fires as soon as an origin rank is scraped (so the page
            # names it), or after `nonfinite_origin_wait` without one: ranks are scraped at
            # different moments. Or non-finite steps that persist, absorbed or not.
            f"(\n  count {c.by_run} ({unabsorbed})\n"
            f"  and {c.on_run} (\n"
            f"    count {c.by_run} ({origins(origin_sel, '')})\n"
            f"    or\n"
            f"    count {c.by_run} ({unabsorbed_late})\n  )\n)\n"
            f"or\ncount {c.by_run} ({persistent})",
            c.nonfinite_for,
            "Gradients became NaN/Inf after the all-reduce and no loss scaler absorbed them.",
            f"{RUN}: reduced gradients were non-finite on {{{{ $value }}}} rank(s) on steps no "
            f"loss scaler skipped in the last {w} (or on more than {c.nonfinite_persistent_steps}"
            f" steps in {c.nonfinite_persistent_window}). Origin rank(s), whose local gradients "
            f"were non-finite before the all-reduce: {rank_list(origin, c, worst_first=False)}.",
        ),
        Alert(
            "DdpmonNonFiniteLoss", L, "critical",
            # delta, not increase: an overflow the scaler absorbed without a non-finite loss
            # moves the record down, which is no counter reset.
            # or: the series began already non-zero (a NaN before Prometheus' first samples,
            # where delta() has nothing to compare) and is younger than the persistent window.
            f"delta({n.LOSS_UNABSORBED}[{w}]) > 0.5\nor\n"
            f"min_over_time({n.LOSS_UNABSORBED}[{young}]) > 0.5\n"
            f"  unless {n.LOSS_UNABSORBED} offset {young}",
            c.nonfinite_for,
            "The training loss became NaN/Inf and no loss scaler absorbed it.",
            f"{RANK}: the observed loss was non-finite in the last {w} on a step the "
            "loss scaler (GradScaler or DeepSpeed) did not skip.",
        ),
        Alert(
            "DdpmonGradNormSpike", L, "warning",
            f"{n.GRAD_NORM_RUN_MAX}\n>\n{c.grad_norm_spike_factor:g} * "
            f"quantile_over_time(0.5, {n.GRAD_NORM_RUN_MAX}[{c.grad_norm_spike_baseline}])",
            c.grad_norm_spike_for,
            "Gradient norm is far above its recent baseline.",
            f"{RUN}: the global gradient norm is {{{{ $value | humanize }}}}, more "
            f"than {c.grad_norm_spike_factor:g}x its {c.grad_norm_spike_baseline} median. "
            f"Largest local (pre-all-reduce) norms on rank(s) {rank_list(largest_local, c)}.",
        ),
        Alert(
            "DdpmonLossSpike", L, "critical",
            f"{sel(c, m.LOSS_SPIKE_UNRECOVERED.name)} >= 0",
            c.loss_spike_for,
            "A loss or gradient-norm spike did not recover.",
            f"{RANK}: the spike that began at step {{{{ $value }}}} is still above its robust "
            "baseline after the agent's spike_recover_steps steps. The loss_spike event in "
            "`ddpmon timeline` names the module group whose update ratio or gradient norm "
            "jumped first, and the batch's sample ids (docs/loss-spikes.md).",
        ),
        *_divergence_alerts(c),
    ]


def _divergence_alerts(c: MixinConfig) -> list[Alert]:
    """Ranks or replicas that should agree and do not: reduced norms, the trainer's own norm,
    parameter checksums."""
    norm = sel(c, m.GRAD_NORM.name, BY_RUN)
    replicas, rw = sel(c, m.REPLICA_MISMATCH.name), c.replica_mismatch_window
    return [
        Alert(
            "DdpmonGradDesync", L, "critical",
            f"{n.GRAD_NORM_RUN_SPREAD} > {c.grad_desync_relative:g}",
            c.grad_desync_for,
            "Post-all-reduce gradient norms differ across ranks; replicas have diverged.",
            f"{RUN}: at the same step, the reduced gradient norms of its ranks "
            "differ by {{ $value | humanizePercentage }} (allowed "
            f"{c.grad_desync_relative:g}); the model replicas are no longer identical. "
            f"Ranks with the highest and lowest norm: "
            f"{rank_list(f'topk(1, {norm}) or bottomk(1, {norm})', c, worst_first=False)}.",
        ),
        Alert(
            "DdpmonGradNormMismatch", L, "warning",
            f"increase({sel(c, m.GRAD_NORM_MISMATCH.name)}[{c.grad_norm_mismatch_window}])"
            " > 0",
            c.grad_norm_mismatch_for,
            "The gradient norm the trainer reported differs from the one ddpmon measured.",
            f"{RANK}: on about {{{{ $value | humanize }}}} step(s) in the last "
            f"{c.grad_norm_mismatch_window} the norm the training loop reported (e.g. its "
            "clip_grad_norm_ result) differed from ddpmon's; one of the two sees different "
            "gradients (scaling, sharding, accumulation).",
        ),
        Alert(
            "DdpmonReplicaDiverged", L, "critical",
            f"increase({replicas}[{rw}]) > 0\nor\n{replicas} > 0 unless {replicas} offset {rw}",
            c.replica_mismatch_for,
            "A data-parallel replica's parameters differ, bit for bit, from the other replicas.",
            f"{RANK}: at a replica check in the last {rw} its parameters' checksums differed "
            "from its replica group's majority (ddpmon_replica_mismatch_total; the "
            "replica_mismatch event names the parameter group). Suspect this GPU (silent data "
            "corruption), or a step this rank skipped alone, or another checkpoint.",
        ),
    ]
