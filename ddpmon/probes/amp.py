"""GradScaler adapter: loss scale and skipped steps without ``get_scale()`` or ``.item()``.

``scaler.update()`` is wrapped on the instance. Before the real update we take the step's
``found_inf`` tensors (device) from the scaler's per-optimizer state; after it we clone the new
``_scale`` tensor (device). Both are read back lazily with the rest of the step record. These are
private GradScaler attributes, stable from torch 2.0 to 2.13; if they move, the probe counts an
error and the rest of the agent keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from .._torch_compat import scaler_enabled, scaler_scale, scaler_state


class ScalerProbe:
    def __init__(
        self,
        scaler: Any,
        optimizer: torch.optim.Optimizer,
        *,
        on_update: Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self._on_update = on_update
        self._on_error = on_error
        self._original = scaler.update
        scaler.update = self._update  # instance attribute shadows the method

    def enabled(self) -> bool:
        return scaler_enabled(self.scaler)

    def current_scale(self) -> torch.Tensor | None:
        """The scale tensor in use (device), for unscaling norms seen inside backward."""
        return scaler_scale(self.scaler)

    def grads_unscaled(self) -> bool:
        """True once ``scaler.unscale_(optimizer)`` ran for this step (host-side state)."""
        try:
            state = scaler_state(self.scaler, self.optimizer)
            return state is not None and state.get("stage") is OptState.UNSCALED
        except Exception:
            return False

    def _found_inf(self) -> torch.Tensor | None:
        state = scaler_state(self.scaler, self.optimizer)
        found = (state or {}).get("found_inf_per_device") or {}
        tensors = list(found.values())
        if not tensors:
            return None
        total = tensors[0].to(torch.float64)
        for t in tensors[1:]:
            total = total + t.to(total.device, torch.float64)
        return total

    def _update(self, new_scale: Any = None) -> None:
        found = before = None
        if self.enabled():
            try:
                found = self._found_inf()
                before = self._snapshot()
            except Exception as exc:
                self._on_error("amp", exc)
        result = self._original(new_scale)
        after = None
        try:
            after = self._snapshot()
        except Exception as exc:
            self._on_error("amp", exc)
        self._on_update(found, before, after)
        return result

    def _snapshot(self) -> torch.Tensor | None:
        """A float64 copy of the current scale, on its device (a device op, not a read)."""
        current = self.current_scale()
        if current is None:
            return None
        return current.detach().reshape(()).to(torch.float64, copy=True)

    def detach(self) -> None:
        if self.scaler.__dict__.get("update") == self._update:
            del self.scaler.update
