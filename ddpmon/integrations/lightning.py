"""Lightning: ``trainer = Trainer(..., callbacks=[DdpmonCallback(port=7470)])``.

The callback attaches in ``on_fit_start``, the first hook after the strategy has wrapped the
model (``trainer.strategy.model``: DDP and the like) and built the optimizers, with the precision
plugin's GradScaler (``16-mixed``); under ``DeepSpeedStrategy``, the strategy's
``deepspeed_engine`` (Lightning runs that strategy on CUDA only). It observes the loss the
closure is about to backpropagate (the step in progress; the value stays on its device) and,
after each optimizer step, hands the gradient norm the user logged (``grad_norm_key``) to
``mon.observe_grad_norm``. It closes the monitor on teardown and on an exception.

Works with the ``lightning`` package and with ``pytorch_lightning``: ``DdpmonCallback`` subclasses
the ``Callback`` of ``lightning.pytorch`` when it is installed, else of ``pytorch_lightning``;
``ddpmon.integrations.pytorch_lightning.DdpmonCallback`` (or ``callback_class(package)``) picks
one explicitly. Lightning is imported when the class is first used, never by ``import ddpmon``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from functools import cache
from typing import Any

import torch

from .._torch_compat import scaler_scale
from ..strategies.deepspeed.source import is_engine
from ._common import NormForwarder, attach_monitor, close_monitor, report_resume

log = logging.getLogger("ddpmon")

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
GRAD_NORM_KEYS = ("grad_norm", "grad_2.0_norm_total")
"""Logged names taken as the trainer's global L2 gradient norm when ``grad_norm_key`` is unset:
a user's ``self.log("grad_norm", ...)`` and the total of ``lightning.pytorch.utilities.grad_norm``
(norm_type 2)."""

__all__ = ["GRAD_NORM_KEYS", "PACKAGES", "DdpmonCallback", "callback_class"]  # noqa: F822 - lazy


class _DdpmonLightning:
    """The callback's behaviour; ``callback_class`` mixes it into a package's ``Callback``."""

    def __init__(self, *, grad_norm_key: str | None = None, **options: Any) -> None:
        """``options`` go to ``ddpmon.attach``. ``grad_norm_key``: the name under which the
        LightningModule logs its global gradient norm (default: any of ``GRAD_NORM_KEYS``)."""
        super().__init__()
        if grad_norm_key is not None and not (isinstance(grad_norm_key, str) and grad_norm_key):
            raise ValueError(f"grad_norm_key must be a non-empty string, got {grad_norm_key!r}")
        self.options = dict(options)
        self.grad_norm_key = grad_norm_key
        self.monitor: Any = None
        self._forwarder: NormForwarder | None = None
        self._accumulate = 1
        self._seen_global_step = 0
        self._scaler: Any = None
        self._last_logged: Any = None
        self._restored: dict[str, bool] = {}

    # ------------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            close_monitor(self.monitor)  # a second fit() on the same callback starts afresh
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        if not optimizers:
            log.warning("ddpmon: the trainer has no optimizer; nothing to monitor")
            self.monitor = None
            return
        if len(optimizers) > 1:
            log.warning(
                "ddpmon: %d optimizers; only the first is monitored (its steps are ddpmon's steps)",
                len(optimizers),
            )
        model = trainer.strategy.model  # the strategy's wrapper (DDP, ...) or the module itself
        optimizer = optimizers[0]
        engine = _deepspeed_engine(trainer.strategy)
        if engine is not None:  # DeepSpeedStrategy: measure through the engine it built
            model, optimizer = engine, engine.optimizer
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.monitor = attach_monitor(model, optimizer, scaler, None, self.options)
        self._scaler = scaler
        _time_checkpoints(trainer, self.monitor)
        self._accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # A resumed run's global step is restored after on_fit_start: report the resume here,
        # so ddpmon counts steps from the checkpoint's step as Lightning does.
        if self.monitor is None:
            return
        global_step = int(trainer.global_step)
        counted_from = global_step  # a later fit() of the same trainer: no load to report
        if self._restored:  # on_load_checkpoint ran: this fit resumed from a checkpoint
            path = getattr(trainer, "ckpt_path", None) or "<lightning checkpoint>"
            counted_from = report_resume(self.monitor, global_step, str(path), **self._restored)
        self._forwarder = NormForwarder(self.monitor, counted_from)
        self._seen_global_step = global_step

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        """A resume (``fit(ckpt_path=...)``): note what it restored (Lightning restores model,
        optimizer, scaler and loop state; RNG only with its own callback). The load runs before
        ``on_fit_start`` attaches ddpmon: ``on_train_start`` reports it."""
        if not isinstance(checkpoint, dict):
            return
        self._restored = {
            "model": "state_dict" in checkpoint,
            "optimizer": bool(checkpoint.get("optimizer_states")),
            "data_loader": "loops" in checkpoint,
        }

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        close_monitor(self.monitor)
        self._restored = {}  # a later fit() reports its own load, or none

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        close_monitor(self.monitor)

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
                             ) -> None:
        """A batch began: its optimizer step is a training step even when ``training_step``
        never calls the module's forward (so no forward hook fires) and the lr is 0 (warm-up)."""
        pipeline = getattr(self.monitor, "flow", None)
        if pipeline is not None:
            with contextlib.suppress(Exception):
                pipeline.batch_started()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """The loss of the step in progress, before its backward (device tensor, not read)."""
        if self.monitor is None:
            return
        try:
            value = loss.detach()
            if self._accumulate > 1 and getattr(pl_module, "automatic_optimization", True):
                value = value * self._accumulate  # Lightning divided it by the window length
            scale = scaler_scale(self._scaler) if self._scaler is not None else None
            if scale is not None:
                # 16-mixed hands this hook the scaled loss; divide on the device (no
                # get_scale(), which reads the value). Same private tensor as ddpmon's AMP probe.
                value = value / scale.to(value.device, value.dtype)
            self.monitor.observe_loss(value)
        except Exception as exc:
            log.debug("ddpmon: loss not observed: %s", exc)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After an optimizer step, forward the norm the module logged for it (if any)."""
        global_step = trainer.global_step
        if self._forwarder is None or global_step == self._seen_global_step:
            return  # no monitor, or a micro-batch inside a gradient-accumulation window
        self._seen_global_step = global_step
        if not self._forwarder.supported:
            return
        value = self._logged_norm(trainer)
        if value is None or _same_storage(value, self._last_logged):
            return  # nothing logged, or the value of an earlier step (not logged this step)
        self._last_logged = value  # holding it keeps its memory from going to a newer value
        self._forwarder.forward(value, global_step)

    def _logged_norm(self, trainer: Any) -> Any:
        """The norm logged during this step: a device tensor, never converted here."""
        try:
            metrics = trainer.callback_metrics
        except Exception:
            return None
        keys = (self.grad_norm_key,) if self.grad_norm_key else GRAD_NORM_KEYS
        for key in keys:
            value = metrics.get(key)
            if value is not None:
                return value
        return None


def _deepspeed_engine(strategy: Any) -> Any:
    """The ``DeepSpeedEngine`` of Lightning's ``DeepSpeedStrategy`` (``deepspeed_engine``, else
    ``strategy.model`` when that is the engine), or None for every other strategy."""

    for name in ("deepspeed_engine", "model"):
        candidate = getattr(strategy, name, None)
        if candidate is not None and is_engine(candidate):
            return candidate
    return None


def _time_checkpoints(trainer: Any, monitor: Any) -> None:
    """Time every checkpoint save through the strategy's CheckpointIO (a public plugin slot):
    ``mon.observe_checkpoint`` around the real write, on the ranks that write."""
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    strategy = trainer.strategy
    try:
        inner = strategy.checkpoint_io
        if isinstance(inner, _TimedCheckpointIO):
            return
        strategy.checkpoint_io = _TimedCheckpointIO(inner, monitor)
    except Exception as exc:  # a strategy without a settable CheckpointIO: saves untimed
        log.warning("ddpmon: Lightning checkpoint saves are not timed (%s)", exc)


class _TimedCheckpointIO:
    """Delegates to the strategy's CheckpointIO; times ``save_checkpoint``."""

    def __init__(self, inner: Any, monitor: Any) -> None:
        self._inner = inner
        self._monitor = monitor

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        step = int(checkpoint.get("global_step", 0) or 0) if isinstance(checkpoint, dict) else 0
        with self._monitor.observe_checkpoint(step, path, "save"):
            self._inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _same_storage(value: Any, previous: Any) -> bool:
    """Is ``value`` the tensor already forwarded? ``callback_metrics`` keeps a norm logged at an
    earlier step until the next log; a new log is a new tensor with its own memory."""
    if not isinstance(value, torch.Tensor) or not isinstance(previous, torch.Tensor):
        return False
    try:
        return value.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr()
    except Exception:
        return False


@cache
def callback_class(package: str | None = None) -> type:
    """``DdpmonCallback`` built on ``package``'s ``Callback`` (``lightning.pytorch`` or
    ``pytorch_lightning``); by default the first of the two that imports."""
    if package is not None and package not in PACKAGES:
        raise ValueError(f"package must be one of {', '.join(PACKAGES)}, got {package!r}")
    errors: list[str] = []
    for name in (package,) if package else PACKAGES:
        try:
            base = importlib.import_module(name).Callback
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return type(
            "DdpmonCallback",
            (_DdpmonLightning, base),
            {"__module__": __name__, "__qualname__": "DdpmonCallback", "__doc__": __doc__},
        )
    raise ImportError(
        "ddpmon's Lightning callback needs `lightning` or `pytorch_lightning` "
        f"(pip install 'ddpmon[lightning]'): {'; '.join(errors)}"
    )


def __getattr__(name: str) -> Any:
    if name == "DdpmonCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
