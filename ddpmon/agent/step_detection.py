"""Optimizer steps and skipped steps that the loop does not announce as such.

- A step the user's loop skips (``if finite: opt.step()``) calls no optimizer: it shows when
  the next forward starts and the last backward's gradients are gone (``zero_grad``) without a
  step having consumed them (:class:`GradSentinel`).
- An *inert* ``optimizer.step()`` (no forward, no backward, lr 0 in every group) is no training
  step: it is how torch creates optimizer state inside checkpoint loaders
  (:func:`is_inert_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._torch_compat import version
from ..host_reads import host_read_free


class GradSentinel:
    """One gradient of the last backward, by identity and version: if either changed, or the
    gradient is gone, the gradients were dropped or replaced."""

    __slots__ = ("_param", "_ref", "_version")

    def __init__(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._param = param
        self._ref = weakref.ref(grad)
        self._version = version(grad)

    @classmethod
    def take(cls, params: Sequence[torch.Tensor]) -> GradSentinel | None:
        """A sentinel on the first parameter with a gradient (None: no gradient at all)."""
        for p in params:
            if p.grad is not None:
                return cls(p, p.grad)
        return None

    def dropped(self) -> bool:
        g = self._param.grad
        return g is None or g is not self._ref() or version(g) != self._version


def is_inert_step(optimizer: Any) -> bool:
    """True when every parameter group of ``optimizer`` has lr 0 (a float, or a one-element CPU
    tensor: reading it is no device sync). The caller has already seen no forward and no
    backward since the last step. An lr on a device, or a group without one, is a real step."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return False
    for group in groups:
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor):
            if not host_read_free(lr.device) or lr.numel() != 1:
                return False
            lr = float(lr)
        if not isinstance(lr, int | float) or lr != 0:
            return False
    return True
