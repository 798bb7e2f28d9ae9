"""Max logits, opt-in (``attach(..., logit_modules=[...])``): the largest value of each named
module's output, read in the forward that computes it (a forward hook, no extra pass).

Why: attention and output logits that grow without bound (the "logit growth" instability of
large-scale training) precede loss spikes; the maximum is the number to watch. The hook runs
one ``amax`` on the device per named module and forward and keeps the running maximum of the
step's forwards (gradient-accumulation micro-steps included); ``take()`` hands the step's values
(NaN for a module that ran no forward) to the step vector, read back lazily with the rest.
A DTensor output (tensor parallel) is read as this rank's piece, without a collective: its max
is the full output's where the output is replicated, this rank's shard's where it is sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._torch_compat import dtensor_local
from ..terminal import clean_line

MAX_LOGIT_MODULES = 16
"""Each module is one series per rank (``ddpmon_logit_max{module}``)."""
MAX_LABEL_CHARS = 160
"""A module name longer than this is exported by its last characters (as ``user_frame``)."""


def module_label(name: str) -> str:
    """A module name as a ``module`` label: control characters spelled out, at most
    ``MAX_LABEL_CHARS`` characters (the end kept: it names the module)."""
    text = clean_line(name)
    return text if len(text) <= MAX_LABEL_CHARS else "..." + text[-(MAX_LABEL_CHARS - 3):]


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    logits = getattr(output, "logits", None)  # a Hugging Face ModelOutput
    return logits if isinstance(logits, torch.Tensor) else None


class LogitProbe:
    """Forward hooks on the named submodules of ``model``."""

    def __init__(
        self,
        model: torch.nn.Module,
        names: Sequence[str],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        if len(names) > MAX_LOGIT_MODULES:
            raise ValueError(f"logit_modules: {len(names)} modules, at most {MAX_LOGIT_MODULES}")
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"logit_modules: no module named {', '.join(map(repr, missing))}")
        self.names = tuple(module_label(n) for n in names)
        """The exported labels (cleaned and capped), in ``names`` order."""
        self._on_error = on_error
        self._max: list[torch.Tensor | None] = [None] * len(self.names)
        self._handles = [
            modules[name].register_forward_hook(self._hook(i)) for i, name in enumerate(names)
        ]

    def _hook(self, i: int) -> Callable:
        def after_forward(module: Any, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():  # evaluation forwards are not the step's
                return
            try:
                tensor = _first_tensor(output)
                if tensor is None or tensor.numel() == 0:
                    return
                if hasattr(tensor, "device_mesh"):  # a DTensor: this rank's piece, no collective
                    tensor = dtensor_local(tensor)
                with torch.no_grad():
                    value = tensor.detach().amax().to(torch.float64).reshape(1)
                    previous = self._max[i]
                    self._max[i] = value if previous is None else torch.maximum(previous, value)
            except Exception as exc:
                self._on_error("logits", exc)

        return after_forward

    def take(self) -> torch.Tensor | None:
        """The step's maxima (device vector, NaN where a module ran no forward), cleared for
        the next step; None when no named module ran."""
        values, self._max = self._max, [None] * len(self.names)
        present = [v for v in values if v is not None]
        if not present:
            return None
        device = present[0].device
        nan = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
        return torch.cat([v.to(device) if v is not None else nan for v in values])

    def close(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()


__all__ = ["MAX_LABEL_CHARS", "MAX_LOGIT_MODULES", "LogitProbe", "module_label"]
