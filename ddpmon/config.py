"""Agent configuration: one validated dataclass, filled from arguments and ``DDPMON_*`` variables.

Explicit arguments win over the environment; every value is checked in ``__post_init__`` so a
bad setting fails with a message that names the option, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PORT = 7470
"""Base port; rank ``r`` on a node serves ``DEFAULT_PORT + LOCAL_RANK``.

Chosen outside 9100-9999 (node_exporter 9100, dcgm-exporter 9400), away from torchrun's 29500
and below Linux's ephemeral range (32768-60999). The node daemon uses ``DEFAULT_PORT - 1``.
"""

ON_NONFINITE_CHOICES = ("record", "skip", "raise", "rerun")
SERIES_PROFILES = ("full", "large")
ON_LOSS_SCALE_FLOOR_CHOICES = ("record", "raise")
ENV_PREFIX = "DDPMON_"


class ConfigError(ValueError):
    """An option has a value ddpmon cannot use; the message names the option and the fix."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything a rank's agent can be told. Field docstrings are the user documentation."""

    enabled: bool = True
    """Master switch; ``False`` installs no hook, thread or server."""
    port: int = DEFAULT_PORT
    """Base port of the /metrics endpoint; the rank serves ``port + LOCAL_RANK``. 0 = no server."""
    bind: str = "0.0.0.0"
    """Address to listen on. Metrics are read-only; use ``127.0.0.1`` to keep them on the host."""
    run_dir: str = "ddpmon-runs"
    """Directory for event logs, evidence and the manifest (``run_dir/<run_id>/``)."""
    run_id: str | None = None
    """Run label shared by all ranks; default: torchrun's run id, else one agreed at attach."""
    group_depth: int = 1
    """Module-name depth for grouped norms (``1``: ``encoder``, ``2``: ``encoder.layers``)."""
    max_groups: int = 32
    """Cardinality bound for ``ddpmon_grad_group_norm``; further groups fold into ``other``."""
    loss_scale_floor: float = 1.0
    """Loss scale (GradScaler or DeepSpeed fp16) at or below which the run is considered
    numerically broken."""
    loss_scale_floor_steps: int = 10
    """Consecutive optimizer steps at or below ``loss_scale_floor`` before
    ``on_loss_scale_floor`` acts (once per episode; a scale above the floor ends it)."""
    on_loss_scale_floor: str = "record"
    """``record`` a ``loss_scale_floor`` event (sync-free), or ``raise``
    ``ddpmon.LossScaleFloorError`` on every rank at the same step (reads the scale each step)."""
    on_nonfinite: str = "record"
    """``record`` (sync-free), ``skip`` the optimizer step on every rank, ``raise``, or
    ``rerun``: run a non-finite step once more on the same batch and RNG state (a loop that
    steps with ``optimizer.step(closure)``), then skip it when the fault did not reproduce
    (transient: suspect the device) or raise when it did (deterministic: the data or the
    numerics). See docs/forensics/hardware-or-numerics.md."""
    rerun_norm_jump: float = 0.0
    """With ``on_nonfinite='rerun'``: also rerun a step whose global gradient norm exceeds this
    factor times the median of the last 32 applied steps (e.g. ``10``); a jump that reproduces
    is the data's and the step goes on, one that does not is skipped. 0 turns it off."""
    stall_seconds: float = 300.0
    """No completed step for this long counts as a hang."""
    hang_seconds: float = 30.0
    """No progress (no step, phase change or new collective) for this long: the rank exports
    what it is stuck in (phase, innermost user frame) for the hang alert (docs/slow-and-stuck)."""
    peak_flops: float = 0.0
    """Dense peak FLOP/s of one rank's device in the training dtype, for MFU; 0: the table of
    known devices (H100, H200, A100, B200, MI300X; docs/goodput.md, MFU)."""
    flops_per_step: float = 0.0
    """FLOPs of one optimizer step on this rank; 0: counted by FlopCounterMode on one step
    (``flops_count_step``, or ``mon.count_flops(step)``)."""
    flops_count_step: int = 3
    """FLOPs per step are counted automatically on this step of the process (after warm-up),
    and again when the batch's shapes change (docs/goodput.md, MFU); 0 turns it off."""
    tokens_per_step: float = 0.0
    """Tokens (or samples) of the batch one optimizer step of this rank trains on, as its
    loader yields it (the whole batch on every TP rank and pipeline stage), for tokens/s, which
    exports this rank's share of it; 0: read from the counted step's batches (the first input's
    leading dims), or given to ``mon.count_flops(step, tokens=...)``."""
    goodput_seconds: float = 60.0
    """Rank 0 recomputes the run's goodput (``ddpmon_goodput_*``, docs/goodput.md) from the run
    dir every this many seconds, on a thread of its own; 0 turns it off."""
    web_config: str | None = None
    """Exporter-toolkit web config file (TLS, basic auth) for the /metrics endpoint."""
    sd_dir: str | None = None
    """If set, write a Prometheus file_sd target file for this rank into this directory."""
    daemon_url: str | None = None
    """If set, register this rank with a ``ddpmon daemon`` for http_sd discovery: its URL (the
    daemon names its agent socket in its answer) or ``unix:PATH`` of that socket."""
    data_check_interval: int = 10
    """Every N steps, compare a fingerprint of each rank's local gradients across ranks (one
    tiny async all-gather) to catch duplicated data shards; 0 turns it off."""
    local_norm_every: int = 10
    """CPU only: measure the local pre-reduction norm (DDP: before the all-reduce; FSDP2, HSDP,
    FSDP2+TP: the reduce-scatter input) every N steps, since a pass over the gradients costs
    milliseconds on CPU; a rank's non-finite local gradients are still found, and named, on
    every step. TP measures local and reduced norms in one shared pass, every step. On GPUs the
    local norm is measured every step."""
    replica_check_every: int = 100
    """Every N steps, compare checksums of the parameters across data-parallel replicas (one
    int64 per parameter group, one small async all-gather over the replica group; DDP, HSDP and
    DeepSpeed ZeRO-0/1/2): a replica whose bits differ from the majority is named
    (``ddpmon_replica_mismatch_total``, a ``replica_mismatch`` event). 0 turns it off."""
    live_refresh_seconds: float = 1.0
    """Minimum age before live readings (NVML, allocator, psutil) are read again at scrape."""
    evidence_max_per_kind: int = 5
    """Evidence bundles kept per kind and rank; later incidents are only logged as events."""
    evidence_tensor_max_elements: int = 4096
    """Offending gradients up to this size are saved whole; larger ones only as a summary."""
    evidence_include_tensors: bool = False
    """Save offending gradients whole regardless of size."""
    evidence_include_inputs: bool = False
    """Opt in to saving the batch (inputs/labels) in evidence. Off: never raw training data."""
    data_version: str | None = None
    """Free-form data set version recorded in the manifest."""
    node: str | None = None
    """Node name label; default: the host name."""
    announce: bool = False
    """Print one line per rank to stderr at attach, naming its /metrics endpoint (off: ddpmon
    writes nothing to stderr on a healthy run)."""
    series_profile: str = "full"
    """Which series each rank exports. ``full``: everything on every rank. ``large`` (very
    large jobs): the reduced per-group norms (``ddpmon_grad_group_norm``, up to ``max_groups``
    series), identical on every rank of a supported strategy, only from rank 0; every other
    series stays per rank. See docs/deployment.md for the counts."""
    linger_seconds: float = 20.0
    """At ``close()``, keep serving /metrics until a store's scraper (Prometheus, vmagent) has
    taken the final step, for at most this long, so a run's last values reach the store. A rank
    scraped before waits at most one scrape interval; one never scraped waits only if it
    published its target (``sd_dir``, ``daemon_url``), and only until this long after attach.
    Set a little over your scrape interval (the default covers the shipped 5 s and 15 s); 0
    never waits."""
    grad_norm_tolerance: float = 1e-3
    """Relative difference above which a trainer-reported grad norm (``observe_grad_norm``)
    counts as a mismatch with ddpmon's own."""
    step_metrics: tuple[str, ...] = ()  # or objects: step_metrics.PerStepMetric
    """Opt-in per-step metrics, by name: ``learning_rate`` (``ddpmon_learning_rate``, the first
    parameter group's lr at each step). Each adds one series per rank, so none is on by default:
    a rank issuing four collective ops is at its 150-series budget without them. As a variable:
    ``DDPMON_STEP_METRICS=learning_rate`` (comma-separated)."""
    update_every: int = 10
    """Every this many steps (and the step after a spike, where no collective is needed), the
    per-group weight norm, update norm ``||dw||``, update/weight ratio and Adam moment norms are
    measured on the device (docs/loss-spikes.md); 0 turns them off. A sampled step copies this
    rank's local weights once (DeepSpeed ZeRO 1-3: its fp32 master partition)."""
    update_copy_budget_mib: int = 1024
    """The most memory (MiB) that copy may take on the device: a model whose local weights are
    larger (a 7B fp32 model under DDP: 28 GB at the optimizer step's peak) gets no update
    figures; the skipped samples are counted and logged once, so the probe never pushes
    training out of memory."""
    update_series: bool = False
    """Also export ``ddpmon_update_ratio{group}`` (up to ``max_groups`` series per rank; off by
    default: the figures are in the history, ``compare`` and ``report``)."""
    spike_window: int = 64
    """Values in each spike baseline (loss, grad norm, each group's norms): median and MAD."""
    spike_threshold: float = 6.0
    """A spike exceeds the baseline median by this many robust standard deviations
    (1.4826 x MAD) ..."""
    spike_min_ratio: float = 1.5
    """... and by at least this factor of the median."""
    spike_recover_steps: int = 50
    """A spike still above its limit after this many steps pages (``DdpmonLossSpike``)."""
    logit_modules: tuple[str, ...] = ()
    """Names of modules (``model.named_modules()``) whose largest output is read on the device
    in the same forward (``ddpmon_logit_max{module}``); at most 16."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Unrecognised options are not allowed; kept only for forward-compatible callers."""

    def __post_init__(self) -> None:
        _check_int("port", self.port, 0, 65535)
        if not isinstance(self.bind, str) or not self.bind:
            raise ConfigError(
                f"bind={self.bind!r}: expected an address such as 0.0.0.0 or 127.0.0.1"
            )
        for name in ("run_dir", "web_config", "sd_dir"):  # pathlib.Path and friends
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError(f"run_dir={self.run_dir!r}: expected a directory path")
        if self.run_id is not None:
            _check_label_value("run_id", self.run_id)
        if self.node is not None:
            _check_label_value("node", self.node)
        _check_int("group_depth", self.group_depth, 0, 16)
        _check_int("max_groups", self.max_groups, 1, 256)
        _check_float("loss_scale_floor", self.loss_scale_floor, 0.0, None)
        _check_int("loss_scale_floor_steps", self.loss_scale_floor_steps, 1, 10**6)
        if self.on_loss_scale_floor not in ON_LOSS_SCALE_FLOOR_CHOICES:
            choices = ", ".join(ON_LOSS_SCALE_FLOOR_CHOICES)
            raise ConfigError(
                f"on_loss_scale_floor={self.on_loss_scale_floor!r}: expected one of {choices}"
            )
        if self.on_nonfinite not in ON_NONFINITE_CHOICES:
            choices = ", ".join(ON_NONFINITE_CHOICES)
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}: expected one of {choices}")
        if self.series_profile not in SERIES_PROFILES:
            choices = ", ".join(SERIES_PROFILES)
            raise ConfigError(
                f"series_profile={self.series_profile!r}: expected one of {choices}"
            )
        _check_float("stall_seconds", self.stall_seconds, 1.0, None)
        _check_float("hang_seconds", self.hang_seconds, 0.5, None)
        _check_float("goodput_seconds", self.goodput_seconds, 0.0, None)
        for name in ("peak_flops", "flops_per_step", "tokens_per_step"):
            _check_float(name, getattr(self, name), 0.0, None)
        _check_int("data_check_interval", self.data_check_interval, 0, 10**6)
        _check_int("flops_count_step", self.flops_count_step, 0, 10**6)
        _check_int("local_norm_every", self.local_norm_every, 1, 10**6)
        _check_int("replica_check_every", self.replica_check_every, 0, 10**6)
        _check_float("rerun_norm_jump", self.rerun_norm_jump, 0.0, None)
        if 0 < self.rerun_norm_jump <= 1:
            raise ConfigError(
                f"rerun_norm_jump={self.rerun_norm_jump!r}: expected 0 (off) or a factor above 1, "
                "such as 10"
            )
        if self.rerun_norm_jump and self.on_nonfinite != "rerun":
            raise ConfigError(
                f"rerun_norm_jump={self.rerun_norm_jump!r} needs on_nonfinite='rerun' (it is "
                f"{self.on_nonfinite!r})"
            )
        _check_float("linger_seconds", self.linger_seconds, 0.0, 600.0)
        _check_float("grad_norm_tolerance", self.grad_norm_tolerance, 0.0, 1.0)
        _check_float("live_refresh_seconds", self.live_refresh_seconds, 0.0, 3600.0)
        _check_int("evidence_max_per_kind", self.evidence_max_per_kind, 0, 1000)
        _check_int("evidence_tensor_max_elements", self.evidence_tensor_max_elements, 0, 10**8)
        self.step_metrics = _check_step_metrics(self.step_metrics)
        _check_int("update_every", self.update_every, 0, 10**6)
        _check_int("update_copy_budget_mib", self.update_copy_budget_mib, 0, 10**8)
        _check_int("spike_window", self.spike_window, 8, 4096)
        _check_float("spike_threshold", self.spike_threshold, 0.0, None)
        _check_float("spike_min_ratio", self.spike_min_ratio, 1.0, None)
        _check_int("spike_recover_steps", self.spike_recover_steps, 1, 10**6)
        if isinstance(self.logit_modules, str) or not isinstance(
            self.logit_modules, (list, tuple)
        ) or not all(isinstance(v, str) and v for v in self.logit_modules) or len(
            self.logit_modules
        ) > 16:
            raise ConfigError(f"logit_modules={self.logit_modules!r}: expected a list of at "
                              "most 16 module names, such as ['lm_head']")
        self.logit_modules = tuple(dict.fromkeys(self.logit_modules))
        if self.web_config is not None and not isinstance(self.web_config, str):
            raise ConfigError(f"web_config={self.web_config!r}: expected a file path")
        if self.extra:
            names = ", ".join(sorted(self.extra))
            raise ConfigError(
                f"unknown option(s): {names}; known options: {', '.join(option_names())}"
            )

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Config:
        """Merge ``DDPMON_*`` variables (lower priority) with explicit ``options``."""
        environ = os.environ if environ is None else environ
        merged: dict[str, Any] = {}
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        for name, fld in known.items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                merged[name] = _parse_env(ENV_PREFIX + name.upper(), raw, fld.type)
        extra: dict[str, Any] = {}
        for key, value in (options or {}).items():
            if key in known:
                merged[key] = value
            else:
                extra[key] = value
        return cls(**merged, extra=extra)


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Config) if f.name != "extra"]


def _parse_env(var: str, raw: str, annotation: Any) -> Any:
    kind = str(annotation)
    if kind.startswith("bool"):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={raw!r}: expected a boolean (1/0, true/false, yes/no, on/off)")
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind.startswith("int"):
        try:
            return int(raw.strip(), 10)
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected an integer") from None
    if kind.startswith("float"):
        try:
            return float(raw.strip())
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected a number") from None
    return raw


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: expected an integer from {low} to {high}")


def _check_float(name: str, value: Any, low: float, high: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = value == value and value >= low and (high is None or value <= high)
        ok = ok and value != float("inf")
    if not ok:
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={value!r}: expected a finite number {bound}")


def _check_step_metrics(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"step_metrics={value!r}: expected a list of names, such as ['learning_rate'], "
            "or per-step metric objects"
        )
    if not value:
        return ()
    from .metrics.step_metrics import (  # imports torch: only when some are asked for
        AVAILABLE,  # imports torch: only when some are asked for
        problem,
    )

    unknown = [v for v in value if isinstance(v, str) and v not in AVAILABLE]
    if unknown:
        raise ConfigError(
            f"step_metrics={list(value)!r}: unknown {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(AVAILABLE)}"
        )
    for entry in value:
        why = None if isinstance(entry, str) else problem(entry)
        if why is not None:
            raise ConfigError(f"step_metrics: {why}")
    by_name = {v if isinstance(v, str) else v.name: v for v in value}
    return tuple(by_name.values())


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What a label value may not hold: C0, DEL, C1 (ESC starts every terminal escape) and the bidi
controls, the characters ``terminal.clean`` spells out."""


def label_problem(value: Any, limit: int = 128) -> str | None:
    """Why ``value`` cannot be a run id or a label (printed on terminals, written into file
    names, served in /metrics), or None when it can."""
    if not isinstance(value, str) or not value or len(value) > limit:
        return f"expected a non-empty string of at most {limit} characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # os.environ's surrogate escape of a byte that is not UTF-8
        return "is not valid UTF-8 (an environment variable with a byte such as \\xff)"
    if _CONTROL.search(value):
        return "must not contain control characters (ESC and friends, bidi overrides)"
    if any(ch in value for ch in "/\\") or value in (".", ".."):
        return "must not contain path separators"
    return None


def _check_label_value(name: str, value: Any) -> None:
    problem = label_problem(value)
    if problem is not None:
        raise ConfigError(f"{name}={value!r}: {problem}")  # repr spells control characters out
