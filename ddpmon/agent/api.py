"""``ddpmon.attach``, and the ``NullMonitor`` it returns when the agent is off or cannot start.

``attach`` never raises into training: a bad option or a failure while building the agent is
logged precisely and gives a ``NullMonitor`` whose ``error`` says why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import Config, ConfigError
from ..strategies.attach_args import Refused, resolve
from .checkpoints import NullTimer
from .monitor import Monitor
from .sinks import Sink

log = logging.getLogger("ddpmon")


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    *,
    comm_hook: Callable | None = None,
    comm_state: Any = None,
    accelerator: Any = None,
    schedule: Any = None,
    sinks: Sequence[Sink] = (),
    **options: Any,
) -> Monitor | NullMonitor:
    """Monitor this rank. Options as in ``ddpmon.Config`` (also ``DDPMON_*`` variables).

    A bad option never stops training: the error is logged precisely and a disabled monitor is
    returned (``mon.enabled`` is False, ``mon.error`` says why).
    ``comm_hook``/``comm_state``: your own DDP communication hook (e.g. PowerSGD); ddpmon wraps it.
    ``accelerator``: a Hugging Face ``Accelerator``; its GradScaler is used. Where it prepared
    an engine, the engine is monitored (``model`` may be the engine or the module inside it).
    Lightning Fabric: ``attach(model, optimizer)`` with what ``fabric.setup`` returned; the
    strategy's module and the real optimizer inside Fabric's wrappers are measured.
    An engine that carries its own optimizer: ``attach(engine)``; its optimizer, loss scaler and
    stage are found from it (docs/parallelism.md).
    ``schedule``: ``model`` is then this rank's stage module or the list of them
    (``model_parts``), and a step is one ``schedule.step()`` (docs/parallelism.md).
    ``sinks``: your own ``Sink`` objects (``ddpmon.agent.sinks.Sink``: ``probe``,
    ``on_record(record)``, ``close()``); each step record goes to them after ddpmon's sinks.
    """
    try:
        config = Config.from_sources(options)
    except ConfigError as exc:
        log.error("ddpmon disabled: invalid configuration: %s", exc)
        return NullMonitor(str(exc))
    if not config.enabled:
        return NullMonitor(None)
    wrong = [type(s).__name__ for s in sinks if not isinstance(s, Sink)]
    if wrong:
        reason = f"sinks: {', '.join(wrong)} lack probe, on_record(record) or close()"
        log.error("ddpmon disabled: %s", reason)
        return NullMonitor(reason)
    try:
        try:
            got = resolve(model, optimizer, scaler, accelerator=accelerator, schedule=schedule)
        except Refused as exc:
            log.error("ddpmon disabled: %s", exc)
            return NullMonitor(str(exc))
        return Monitor.build(got.model, got.optimizer, got.scaler, config, comm_hook, comm_state,
                             plan=got.plan, sinks=tuple(sinks))
    except Exception as exc:  # never into training: an agent that cannot start stays off
        log.error("ddpmon disabled: could not attach (%s: %s)", type(exc).__name__, exc)
        return NullMonitor(f"could not attach: {type(exc).__name__}: {exc}")


class NullMonitor:
    """What ``attach`` returns when the agent is off: every call is accepted and ignored."""

    enabled = False
    step = 0
    port = None
    state = None
    exposition = None
    identity = None
    run_id = None
    run_path = None

    def __init__(self, error: str | None) -> None:
        self.error = error

    def observe_loss(self, loss: Any) -> None:
        pass

    def observe_grad_norm(self, value: Any, step: int | None = None) -> None:
        pass

    def observe_samples(self, ids: Any) -> None:
        pass

    def run_step(self, closure: Any) -> Any:
        return closure()  # the loop's step runs as it would without ddpmon

    def annotate(self, **fields: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def recent_steps(self) -> list:
        return []

    def owns(self, params: Sequence[torch.Tensor]) -> bool:
        return False

    def observe_checkpoint(self, step: int, path: Any, kind: str = "save", **_: Any) -> NullTimer:
        return NullTimer()

    def phase(self, name: str, quiet: bool = True) -> Any:
        return contextlib.nullcontext()

    def count_flops(self, step: Any, tokens: float | None = None) -> Any:
        return step()

    def close(self) -> None:
        pass

    def __enter__(self) -> NullMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
