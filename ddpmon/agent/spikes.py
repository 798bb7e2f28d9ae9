"""Loss and gradient-norm spikes, named: the step, the module group that jumped first, the batch.

A record sink (record thread, host values only). Each signal keeps a robust rolling baseline:
the median and the median absolute deviation (MAD) of its last ``window`` values, so one outlier
moves neither. A value is a spike when it exceeds the median by both ``threshold`` robust
standard deviations (``1.4826 * MAD``) and ``min_ratio - 1`` times the median's size::

    limit = median + max(threshold * 1.4826 * MAD, (min_ratio - 1) * |median|)

Signals: the loss and the global gradient norm open a spike; every group's gradient norm (each
step) and update/weight ratio (sampled steps, ``probes.updates``) are watched the same way, and
their jumps of the last ``lookback`` steps name the group that led: the earliest jump, the
largest one among equals. The spike's step is the earliest of that jump and the detection: a
learning-rate error at step s shows in that group's update ratio at s and in the loss at s + 1.
A group's update ratio that jumps by ``update_factor`` times its median or more opens a spike
by itself (``signal="update_ratio"``): a one-step learning-rate error that the loss absorbs is
still an event, at its step, naming its group. A linear warm-up from zero never grows the ratio
that fast against a window's median; an exponential one may.

A spike that falls back under its limit within ``recover_steps`` is a ``loss_spike`` event and
nothing more; one that does not is a ``loss_spike_unrecovered`` event and sets
``ddpmon_loss_spike_unrecovered_step`` (the ``DdpmonLossSpike`` alert) until it recovers.
Spike values are kept out of the baselines. Memory is bounded: a window per signal and per group
(at most ``max_groups``), and the last ``lookback`` jumps and sample ids.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..metrics.state import StepRecord

MAD_SIGMA = 1.4826
"""MAD to standard deviation for normal noise."""
MAX_SAMPLE_IDS = 64
"""Sample ids kept in one event (the batch's first ones)."""


@dataclass(frozen=True, slots=True)
class SpikeSettings:
    window: int = 64
    threshold: float = 6.0
    min_ratio: float = 1.5
    recover_steps: int = 50
    lookback: int = 16
    warmup: int = 16
    """Values a baseline needs before it can call a spike (sampled update ratios: a quarter)."""
    update_factor: float = 4.0
    """A group's update ratio this many times its median opens a spike by itself."""


class Baseline:
    """The last ``size`` values of one signal and the spike limit they set."""

    __slots__ = ("values", "warmup")

    def __init__(self, size: int, warmup: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.warmup = warmup

    def limit(self, settings: SpikeSettings) -> tuple[float, float] | None:
        """(median, limit), or None while warming up."""
        if len(self.values) < self.warmup:
            return None
        ordered = sorted(self.values)
        median = _median(ordered)
        mad = _median(sorted(abs(v - median) for v in ordered))
        margin = max(settings.threshold * MAD_SIGMA * mad, (settings.min_ratio - 1) * abs(median))
        return median, median + margin


@dataclass(slots=True)
class _Open:
    signal: str
    onset: int
    detected: int
    limit: float
    paged: bool = False
    group: str | None = None
    """The group of an ``update_ratio`` spike (its ratio decides the recovery)."""
    told: bool = True
    """A ``loss_spike`` event was written for it (False: the same onset, seen again)."""


SAMPLE_STEPS_KEPT = 1024 + 64
"""Steps whose sample ids are kept: the readback's bound on pending steps (1,024), plus the
lookback."""


class SpikeDetector:
    """``on_record`` per step record; emits ``loss_spike`` events (see the module doc)."""

    probe = "spikes"

    def __init__(
        self,
        settings: SpikeSettings,
        emit: Callable[..., None],
        on_page: Callable[[int | None], None],
        on_spike: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.s = settings
        self._emit = emit
        self._on_page = on_page
        self._on_spike = on_spike
        self._on_close = on_close
        self._signals = {name: Baseline(settings.window, settings.warmup)
                         for name in ("loss", "grad_norm")}
        self._groups: dict[tuple[str, str], Baseline] = {}
        self._jumps: deque[tuple[int, str, str, float]] = deque(maxlen=4 * settings.lookback)
        # the record thread can trail the loop by as many steps as the readback holds (on a
        # loaded host, tens): ids are kept that long, copies of at most MAX_SAMPLE_IDS each
        self._samples: deque[tuple[int, Any]] = deque(maxlen=SAMPLE_STEPS_KEPT)
        self._open: _Open | None = None
        self._ratio_bounds: dict[str, tuple[float, tuple[float, float]]] = {}
        self._last_onset: int | None = None
        self.events = 0

    def note_samples(self, step: int, ids: Any) -> None:
        """The batch's sample ids of ``step``, copied (a reused or prefetched buffer holds a
        later batch's ids by the time a spike is read) without a host read: see ``_copy_ids``."""
        self._samples.append((step, _copy_ids(ids)))

    def on_record(self, record: StepRecord) -> None:
        self._ratio_bounds = {}
        self._watch_groups(record.step, "grad_norm", record.group_norms, self.s.warmup)
        if record.update_stats:
            ratios = {g: f["update_ratio"] for g, f in record.update_stats.items()
                      if "update_ratio" in f}
            self._watch_groups(record.step, "update_ratio", ratios,
                               max(4, self.s.warmup // 4))
        values = {"loss": record.loss, "grad_norm": record.grad_norm}
        if self._open is not None:
            self._follow(record.step, self._value_of(self._open, values, record))
            return
        for signal, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            baseline = self._signals[signal]
            bounds = baseline.limit(self.s)
            if bounds is not None and value > bounds[1]:
                self._start(record.step, signal, value, bounds)
                return
        ratio = self._ratio_jump(record.step)
        if ratio is not None:
            group, value, bounds = ratio
            self._start(record.step, "update_ratio", value, bounds, group)
        for signal, value in values.items():
            if value is not None and math.isfinite(value):
                self._signals[signal].values.append(value)

    def _watch_groups(self, step: int, signal: str, values: dict, warmup: int) -> None:
        for group, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            baseline = self._groups.get((signal, group))
            if baseline is None:
                size = self.s.window if signal == "grad_norm" else max(8, self.s.window // 4)
                baseline = self._groups[(signal, group)] = Baseline(size, warmup)
            bounds = baseline.limit(self.s)
            if bounds is not None and value > bounds[1]:
                factor = value / bounds[0] if bounds[0] > 0 else math.inf
                self._jumps.append((step, signal, group, factor))
                if signal == "update_ratio":
                    self._ratio_bounds[group] = (value, bounds)
            else:
                baseline.values.append(value)

    def _ratio_jump(self, step: int) -> tuple[str, float, tuple[float, float]] | None:
        """The largest update-ratio jump of ``step`` by ``update_factor`` or more, if any."""
        best = None
        for s, signal, group, factor in self._jumps:
            if s == step and signal == "update_ratio" and factor >= self.s.update_factor and (
                best is None or factor > best[1]
            ):
                best = (group, factor)
        if best is None or best[0] not in self._ratio_bounds:
            return None
        value, limits = self._ratio_bounds[best[0]]
        return best[0], value, limits

    def _value_of(self, spike: _Open, values: dict, record: StepRecord) -> float | None:
        if spike.group is None:
            return values.get(spike.signal)
        figures = (record.update_stats or {}).get(spike.group) or {}
        return figures.get("update_ratio")

    def _leader(self, step: int) -> tuple[int, str, str, float] | None:
        recent = [j for j in self._jumps if step - self.s.lookback <= j[0] <= step]
        if not recent:
            return None
        return min(recent, key=lambda j: (j[0], -j[3]))

    def _start(self, step: int, signal: str, value: float, bounds: tuple[float, float],
               group: str | None = None) -> None:
        leader = self._leader(step)
        onset = min(step, leader[0]) if leader is not None else step
        spike = _Open(signal, onset, step, bounds[1], group=group)
        if onset == self._last_onset:  # the same spike, seen again in another signal
            spike.told = False
            self._open = spike
            return
        fields: dict[str, Any] = {
            "signal": signal, "value": value, "baseline": bounds[0], "limit": bounds[1],
            "detected_step": step,
        }
        if leader is not None:
            fields.update(group=leader[2], group_signal=leader[1], group_step=leader[0],
                          group_factor=leader[3] if math.isfinite(leader[3]) else None)
        ids = self._ids(step)
        if ids is not None:
            fields["sample_ids"] = ids
        self._emit("loss_spike", onset, **fields)
        # only once told: an emit that fails leaves no open spike, the next record tries again
        self._open, self._last_onset = spike, onset
        self.events += 1
        if self._on_spike is not None:
            self._on_spike()

    def _follow(self, step: int, value: float | None) -> None:
        spike = self._open
        if value is not None and math.isfinite(value) and value <= spike.limit:
            if spike.told or spike.paged:  # else: seen again in another signal, already told
                self._emit("loss_spike_recovered", spike.onset, signal=spike.signal,
                           recovered_step=step, steps=step - spike.detected)
            self._open = None  # after the emit: a failed one is tried again at the next record
            if spike.paged:
                self._on_page(None)
            return
        if not spike.paged and step - spike.detected >= self.s.recover_steps:
            self._emit("loss_spike_unrecovered", spike.onset, signal=spike.signal,
                       steps=step - spike.detected, limit=spike.limit)
            spike.paged = True
            self._on_page(spike.onset)

    def close(self) -> None:
        """The agent closes (the detector is its last record sink): close the probes too."""
        if self._on_close is not None:
            self._on_close()

    def _ids(self, step: int) -> list | None:
        for seen, ids in reversed(list(self._samples)):  # a snapshot: the training thread appends
            if seen == step:
                return _id_list(ids)
        return None


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _copy_ids(ids: Any) -> Any:
    """The first ``MAX_SAMPLE_IDS`` ids, copied where they are noted (training thread). A
    tensor is never read here: on the CPU a clone; on an accelerator a non-blocking copy into
    pinned host memory, which the record thread reads much later, with no device sync. Other
    values: a list of the first ones."""
    try:
        if isinstance(ids, torch.Tensor):
            head = ids.detach().reshape(-1)[:MAX_SAMPLE_IDS]
            if head.device.type == "cpu":
                return head.clone()
            return head.to("cpu", non_blocking=True)
        if isinstance(ids, list | tuple):
            return list(ids[:MAX_SAMPLE_IDS])
    except Exception:
        return None
    return ids


def _id_list(ids: Any) -> list | None:
    """Up to ``MAX_SAMPLE_IDS`` ids as plain values (a tensor is read here, on the record
    thread, never on the training thread)."""
    try:
        if hasattr(ids, "tolist"):
            ids = ids.reshape(-1)[:MAX_SAMPLE_IDS].tolist() if hasattr(ids, "reshape") \
                else ids.tolist()
        values = list(ids)[:MAX_SAMPLE_IDS]
    except Exception:
        return None
    return [v if isinstance(v, int | float) else str(v)[:200] for v in values]


__all__ = ["Baseline", "SpikeDetector", "SpikeSettings"]
