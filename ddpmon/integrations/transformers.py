"""Hugging Face Transformers: ``Trainer(..., callbacks=[DdpmonCallback(port=7470)])``.

``on_train_begin`` runs after Accelerate prepared the model and the optimizer. Callbacks are
handed the bare model and Accelerate's optimizer wrapper, but ddpmon needs the DDP wrapper (its
communication hook sees each rank's gradients before the all-reduce) and the torch optimizer
inside (whose step hooks fire once per optimizer step, never per micro-batch of gradient
accumulation). Transformers gives a callback no reference to its Trainer, so the callback finds
the calling Trainer on the call stack (``Trainer(..., callbacks=[cb])`` or
``trainer.add_callback(cb)``) or takes it from ``DdpmonCallback(trainer=...)``; from the Trainer
it uses the public ``model_wrapped`` and ``accelerator`` (whose GradScaler serves fp16). With a
DeepSpeed config ``model_wrapped`` is the ``DeepSpeedEngine`` (also ``trainer.deepspeed``), so
ddpmon attaches to the engine as ``ddpmon.attach(engine)`` does (docs/parallelism.md, DeepSpeed).

Under ``on_nonfinite="rerun"`` the callback records the step's ``training_step`` calls
(``_trainer_replay``), so that ddpmon can run the step once more from the optimizer's pre-hook:
the Trainer steps without a closure, and the model needs no change.

Per step it adds no host read. The loss is summed on the device from the model output's ``loss``
of each micro-batch (a forward hook), weighted as the Trainer weights it, so ``ddpmon_loss`` is
this rank's loss of the optimizer step, the quantity whose mean over ranks the Trainer logs. The
gradient norm the Trainer logs (``grad_norm``, a Python float it already read) goes to
``mon.observe_grad_norm`` for the step it belongs to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..strategies.accelerate import unwrap_optimizer
from ._common import NormForwarder, attach_monitor, close_monitor, report_resume
from ._trainer_replay import StepRecorder

log = logging.getLogger("ddpmon")


def _resumed_from(args: Any, global_step: int) -> tuple[str, dict[str, bool | None]]:
    """Where a resume at ``global_step`` came from and what the Trainer restored from it: the
    model, optimizer and scheduler always; the scaler and the RNG states (at its first step)
    when their files are in the checkpoint; the data position unless ``ignore_data_skip``. The
    checkpoint is ``output_dir/checkpoint-<step>`` when that exists (``resume_from_checkpoint``
    itself is not kept by the Trainer)."""
    restored: dict[str, bool | None] = {
        "model": True, "optimizer": True,
        "data_loader": not bool(getattr(args, "ignore_data_skip", False)),
    }
    named = getattr(args, "resume_from_checkpoint", None)
    candidates = [named] if isinstance(named, str) else []
    candidates.append(os.path.join(str(getattr(args, "output_dir", "") or ""),
                                   f"checkpoint-{global_step}"))
    for path in candidates:
        if path and os.path.isdir(path):
            files = os.listdir(path)
            restored["scaler"] = "scaler.pt" in files or None
            restored["rng"] = any(f.startswith("rng_state") for f in files) or None
            return path, restored
    return f"<transformers checkpoint of step {global_step}>", restored

__all__ = ["DdpmonCallback"]

_STACK_DEPTH = 16


class DdpmonCallback(TrainerCallback):
    """Attach ddpmon to the model, optimizer and scaler of a Transformers ``Trainer``."""

    def __init__(self, trainer: Trainer | None = None, **options: Any) -> None:
        """``options`` go to ``ddpmon.attach``; ``trainer`` only where the callback is driven
        by something other than that Trainer's own callback handler."""
        if trainer is not None and not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer)!r}")
        self.options = dict(options)
        self.monitor: Any = None
        self._trainer = trainer
        self._forwarder: NormForwarder | None = None
        self._loss_hook: Any = None
        self._step_loss: Any = None
        self._token_scale = 1
        self._accumulation: Any = None
        self._save_timer: Any = None
        self._recorder: Any = None
        """Under ``on_nonfinite="rerun"``: the step's ``training_step`` calls, for a rerun."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self._detach()  # a second train() on the same callback starts afresh
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        trainer = self._trainer or _calling_trainer()
        accelerator = None
        if trainer is not None:
            # DDP wrapper, or the DeepSpeedEngine under a DeepSpeed config
            model = getattr(trainer, "model_wrapped", None) or model
            accelerator = getattr(trainer, "accelerator", None)
        else:
            log.warning(
                "ddpmon: no Trainer found for DdpmonCallback; monitoring the bare model "
                "(no DDP communication hook: no pre-all-reduce norms, no NaN origin rank). "
                "Pass DdpmonCallback(trainer=trainer) to fix this."
            )
        if model is None or optimizer is None:
            log.warning("ddpmon: the Trainer handed no model or optimizer; nothing to monitor")
            return
        scaler = getattr(accelerator, "scaler", None) or getattr(optimizer, "scaler", None)
        self.monitor = attach_monitor(
            model, unwrap_optimizer(optimizer), scaler, accelerator, self.options
        )
        if self.monitor is None:
            return
        # A resume restored the Trainer's state before this hook: count from its global step.
        global_step = int(state.global_step)
        path, restored = _resumed_from(args, global_step)
        counted_from = report_resume(self.monitor, global_step, path, **restored)
        self._forwarder = NormForwarder(self.monitor, counted_from)
        # How the Trainer weights a micro-batch's loss into the step's (see _on_model_output).
        if getattr(args, "average_tokens_across_devices", False):
            self._token_scale = int(getattr(accelerator, "num_processes", 1) or 1)
        steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self._accumulation = lambda: getattr(trainer, "current_gradient_accumulation_steps", steps)
        try:
            self._loss_hook = kwargs["model"].register_forward_hook(
                self._on_model_output, with_kwargs=True
            )
        except Exception as exc:
            log.debug("ddpmon: no loss hook: %s", exc)
        rerun = getattr(self.monitor.flow, "rerun", None)
        if rerun is not None and trainer is not None and not getattr(
                self.monitor.state, "strategy", "").startswith("deepspeed"):
            self._recorder = StepRecorder(trainer, rerun)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_loss = None  # a new optimizer step: its first micro-batch comes next
        if self._recorder is not None:
            self._recorder.new_step()
        pipeline = getattr(self.monitor, "flow", None)
        if pipeline is not None:  # a training step, even at a warm-up's lr 0
            with contextlib.suppress(Exception):
                pipeline.batch_started()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recorder is not None:
            self._recorder.new_step()  # the step's batch is not kept past its step
        self._arm_save_timer(args, state, control)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        """The Trainer logs ``grad_norm`` right after the optimizer step it measured."""
        self._arm_save_timer(args, state, control)  # logging comes before the save
        if self._forwarder is None or not logs or "grad_norm" not in logs:
            return
        self._forwarder.forward(logs["grad_norm"], int(state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._arm_save_timer(args, state, control)  # so does evaluation

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer calls this right after it wrote ``checkpoint-<step>``: the save is timed
        from the last callback before it (step end, log or evaluation), i.e. the save itself."""
        timer, self._save_timer = self._save_timer, None
        if timer is not None:
            try:
                timer.done()
            except Exception as exc:
                log.debug("ddpmon: checkpoint not recorded: %s", exc)

    def _arm_save_timer(self, args: Any, state: Any, control: Any) -> None:
        if self.monitor is None or not getattr(control, "should_save", False):
            return
        step = int(state.global_step)
        path = f"{args.output_dir}/checkpoint-{step}"
        try:
            self._save_timer = self.monitor.observe_checkpoint(step, path, "save")
        except Exception as exc:
            log.debug("ddpmon: checkpoint not timed: %s", exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    def _on_model_output(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        """Add this micro-batch's share to the step's loss, on the device.

        Given ``num_items_in_batch`` the model already divided by the window's token count (of
        all ranks when ``average_tokens_across_devices``, which the Trainer undoes by the number
        of processes); otherwise the Trainer divides each micro-batch's mean by the window length.
        """
        if not module.training or self.monitor is None:
            return
        if self._recorder is not None and self._recorder.rerun.rerunning:
            return  # the same step once more: its loss is already counted
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            return
        try:
            part = loss.detach().float()
            if kwargs.get("num_items_in_batch") is not None:
                part = part * self._token_scale
            elif self._accumulation is not None:
                part = part / max(1, int(self._accumulation()))
            self._step_loss = part if self._step_loss is None else self._step_loss + part
            self.monitor.observe_loss(self._step_loss)  # the running sum; kept on its device
        except Exception as exc:
            log.debug("ddpmon: loss not observed: %s", exc)

    def _detach(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        close_monitor(self.monitor)
        self._forwarder = None


def _calling_trainer() -> Trainer | None:
    """The Trainer whose callback handler is calling us, from the call stack (bounded)."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
