"""What the framework callbacks share: a guarded attach, the trainer-norm hand-off, a safe close.

A callback runs inside the framework's training loop, so nothing here may raise into it: every
failure is logged once and the callback carries on (or stays detached).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import ddpmon

log = logging.getLogger("ddpmon")


def attach_monitor(
    model: Any, optimizer: Any, scaler: Any, accelerator: Any, options: dict[str, Any]
) -> Any:
    """``ddpmon.attach`` for a framework callback; None (logged) if attaching failed.

    ``accelerator`` is handed to ``attach`` where the agent accepts it (it then takes the scaler
    from it); otherwise the scaler found by the callback is passed directly.
    """
    try:
        attach = ddpmon.attach
        if accelerator is not None and "accelerator" in inspect.signature(attach).parameters:
            return attach(model, optimizer, accelerator=accelerator, **options)
        return attach(model, optimizer, scaler, **options)
    except Exception as exc:
        log.error("ddpmon: could not attach (%s: %s); training continues", type(exc).__name__, exc)
        return None


def report_resume(monitor: Any, global_step: int, path: str, **restored: bool | None) -> int:
    """A trainer that restored a checkpoint before its callbacks attached ddpmon (Lightning's
    ``fit(ckpt_path=)``, the HF Trainer's ``train(resume_from_checkpoint=)``): report the
    resume as a load at ``global_step`` (the optimizer steps the checkpoint holds), so ddpmon
    numbers the steps from there as the trainer does, and the manifest and timeline record what
    was restored. Returns the global step the trainer had when ddpmon's counting began (the
    :class:`NormForwarder` offset): 0 once counting is rebased, ``global_step`` if it could not
    be (a monitor that already counted steps)."""
    if global_step <= 0 or monitor is None:
        return 0
    try:
        monitor.observe_checkpoint(global_step, path, "load", **restored).done()
    except Exception as exc:
        log.warning("ddpmon: the resume was not recorded (%s); training continues", exc)
    counted_from = getattr(getattr(monitor, "pipeline", None), "step", None)
    return 0 if counted_from == global_step else global_step


class NormForwarder:
    """Hands a trainer-reported gradient norm to ``mon.observe_grad_norm`` once per step.

    The step is ddpmon's 0-based step index: the trainer's global step after the optimizer step,
    minus one, minus the global step the trainer had when ddpmon began counting (0 after
    :func:`report_resume`, which makes ddpmon count from the checkpoint's step).
    """

    def __init__(self, monitor: Any, first_global_step: int) -> None:
        self._observe = getattr(monitor, "observe_grad_norm", None)
        self._first = first_global_step
        self._last_step: int | None = None
        self._warned = False

    @property
    def supported(self) -> bool:
        """False on an agent without ``observe_grad_norm``: nothing is compared then."""
        return self._observe is not None

    def step_for(self, global_step: int) -> int | None:
        """ddpmon's index of the step that brought the trainer to ``global_step``."""
        step = global_step - 1 - self._first
        return step if step >= 0 else None

    def forward(self, value: Any, global_step: int) -> bool:
        """Pass ``value`` (float or device tensor, never read here) for ``global_step``."""
        step = self.step_for(global_step)
        if self._observe is None or value is None or step is None or step == self._last_step:
            return False
        self._last_step = step
        try:
            self._observe(value, step=step)
            return True
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("ddpmon: observe_grad_norm failed (%s); training continues", exc)
            return False


def close_monitor(monitor: Any) -> None:
    """``mon.close()`` that never raises into the framework's teardown."""
    if monitor is None:
        return
    try:
        monitor.close()
    except Exception as exc:
        log.warning("ddpmon: close failed (%s: %s)", type(exc).__name__, exc)
