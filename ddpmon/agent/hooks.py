"""The hooks that tell the step flow where a training step is.

- forward pre-hook on the model: a (micro-)step's first forward, the batch shapes;
- forward hook: a grad hook on the outputs that, when backward reaches them, queues a callback
  for the end of that backward pass. The callback re-queues itself once so that it runs after
  the autograd engine's other final callbacks (a data-parallel wrapper's post-backward work),
  when every gradient of the pass is in place;
- optimizer step pre/post hooks, or ``scaler.update()`` when a GradScaler decides the step.
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import queue_backward_callback
from ..probes.amp import ScalerProbe
from .step_flow import StepFlow


class StepHooks:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        flow: StepFlow,
        amp: ScalerProbe | None,
        *,
        engine_steps: bool = False,
    ) -> None:
        """``engine_steps``: the model is an engine that decides its own optimizer steps
        (``GradientSource.decides_steps``: its own markers report the steps); only the forward
        pre-hook is used."""
        self.flow = flow
        self.amp = amp
        self.closed = False
        self._handles: list[Any] = []
        try:
            self._handles.append(model.register_forward_pre_hook(self._on_forward))
            if engine_steps:
                return
            self._handles.append(model.register_forward_hook(self._after_forward))
            if amp is None:
                self._handles.append(optimizer.register_step_pre_hook(self._on_step_pre))
                self._handles.append(optimizer.register_step_post_hook(self._on_step_post))
        except BaseException:
            self.close()  # all or nothing
            raise

    # Hook bodies stay tiny: the flow guards its own work; what runs here before reaching it
    # is guarded too (nothing raises into forward, backward or the optimizer step).
    def _on_forward(self, module: Any, args: tuple) -> None:
        if not self.closed and torch.is_grad_enabled():
            self.flow.forward_started(args)

    def _after_forward(self, module: Any, args: tuple, output: Any) -> None:
        if self.closed or not torch.is_grad_enabled():
            return
        self.flow.split.forward_ended()
        with self.flow.guard("step"):
            if isinstance(output, torch.Tensor):  # the common case: one cheap node pre-hook
                node = output.grad_fn
                if node is not None:
                    node.register_prehook(self._on_output_grad)
                elif output.requires_grad:
                    output.register_hook(self._on_output_grad)
                return
            tensors = _grad_outputs(output)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._on_output_grad, mode="any"
                )

    def _on_output_grad(self, grad: Any) -> None:
        """Backward reached the model's output (a tensor hook or its node's pre-hook). The
        end-of-backward callback goes through the autograd engine's ``queue_callback``, a
        private torch API (``_torch_compat.queue_backward_callback``): a torch without it costs
        the end-of-backward boundary (the step's gradients are then collected at the optimizer
        step), said once; any other failure is counted under ``step``, never an exception in
        backward."""
        with self.flow.guard("step"):
            queue_backward_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        if not self.closed:
            self.flow.backward_ended()

    def _on_step_pre(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        if not self.closed:
            return self.flow.optimizer_pre(args, kwargs)  # a replaced closure, or None
        return None

    def _on_step_post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if not self.closed:
            self.flow.optimizer_post()

    def close(self) -> None:
        self.closed = True
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        if self.amp is not None:
            self.amp.detach()


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    """Output tensors that take part in autograd, one container level deep (tuples, lists,
    dicts and Hugging Face ``ModelOutput``s)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    else:
        return []
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
