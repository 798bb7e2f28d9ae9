"""Where a NaN entered a tensor-parallel model: the block whose output gradient went non-finite
on this rank first in backward.

Under tensor parallelism with sequence parallel (torchtitan's TP plan) the collectives inside a
block's backward spread a NaN to every TP rank before any parameter gradient is ready: a NaN put
into ``layers.3``'s output gradient on rank 1 reaches ``w2``'s weight gradient on both ranks
through the all-gather in ``w2``'s backward, so both ranks' first non-finite parameter in
backward order is the same and the parameters cannot say which rank it began on. What differs is
the gradient *between* blocks: there the residual stream is sequence-sharded, each rank holds the
gradient of its own tokens, and no collective has mixed it yet. Rank 1's ``layers.3`` output
gradient is non-finite; rank 0's is finite, and its first non-finite block output is
``layers.2`` (after attention's backward has mixed the tokens). The block nearest the loss whose
output gradient is non-finite, per rank, tells the ranks apart: the timeline names the rank
whose entry is nearest the loss (``forensics.entry``).

Cost: a forward hook on each top-level block (the children of the model's largest
``ModuleList``, ``ModuleDict`` or ``Sequential``: ``top_level_blocks``) registers a pre-hook on
the output's ``grad_fn``; in backward that takes the float32 sum of this rank's local piece of
the gradient (one reduction kernel per block and micro-batch; the sum is NaN or Inf exactly when
an element is, or when finite values add up past 3.4e38). When the step ends the sums are
stacked and added into one value per block (three device ops a step), a slot of the step vector
(``ENTRY_BLOCKS``) read back lazily with the step's other values: no host read. A ``grad_fn``
pre-hook runs after every hook registered on the tensor itself (autograd runs tensor hooks
first), so the check sees the gradient autograd goes on with, whoever changed it. A block
compiled in place (``module.compile()``, whose trace takes in its hooks) is not checked. Installed
for the TP strategies only, where the parameters cannot tell (``tp``, ``fsdp2+tp``, ``hsdp+tp``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .dtensor_norms import is_dtensor

__all__ = ["BlockEntry", "tensor_parallel", "top_level_blocks"]

_MAX_CHECKS = 1 << 14
"""Checks kept between two steps (one per block and micro-batch): bounded if no step ends."""


def tensor_parallel(strategy: str) -> bool:
    """The strategies whose ranks share a NaN inside a block's backward (``tp``, ``*+tp``)."""
    return strategy == "tp" or strategy.endswith("+tp")


def top_level_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order: the children of its largest ``ModuleList``,
    ``ModuleDict`` or ``Sequential`` (the model itself included; among equals the shallowest),
    if it holds two or more modules."""
    best: tuple[int, int] | None = None
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential):
            continue
        children = list(module.named_children())
        rank = (len(children), -name.count(".") - bool(name))
        if len(children) >= 2 and (best is None or rank > best):
            best = rank
            blocks = [(f"{name}.{k}" if name else k, child) for k, child in children]
    return blocks


class BlockEntry:
    """Per step, which top-level blocks' output gradients were non-finite on this rank."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]],
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.names = [name for name, _ in blocks]
        self._on_error = on_error
        self._seen: list[tuple[int, torch.Tensor]] = []
        """(block position, float32 sum of its output gradient) per check since the last take;
        appended by backward, swapped whole by ``take`` (after backward: no lock needed)."""
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None
        """The last step's positions in check order and their device index (built again only
        when the order changes)."""
        self._handles = [
            block.register_forward_hook(self._forward_hook(position))
            for position, (_, block) in enumerate(blocks)
        ]
        self.enabled = True

    @classmethod
    def install(cls, model: nn.Module,
                on_error: Callable[[str, BaseException], None]) -> BlockEntry | None:
        blocks = top_level_blocks(model)
        return cls(blocks, on_error) if blocks else None

    def close(self) -> None:
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_hook(self, position: int) -> Callable[..., None]:
        def after_forward(_module: nn.Module, _args: Any, output: Any) -> None:
            # inside a compiled block (``module.compile()`` traces its hooks) there is no
            # grad_fn to hook, and under fullgraph an attempt would fail the compile: skipped
            if not self.enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return
            try:
                out = _first_tensor(output)
                if out is None or not out.requires_grad or out.grad_fn is None:
                    return
                out.grad_fn.register_prehook(self._grad_check(position, out.output_nr))
            except Exception as exc:  # noqa: BLE001 - counted, never raised into the forward
                self._on_error("grads", exc)

        return after_forward

    def _grad_check(self, position: int, output_nr: int) -> Callable[[Any], None]:
        def check(grad_outputs: Any) -> None:
            if not self.enabled or len(self._seen) >= _MAX_CHECKS:
                return
            try:
                grad = grad_outputs[output_nr] if output_nr < len(grad_outputs) else None
                if grad is None:
                    return
                local = grad.to_local() if is_dtensor(grad) else grad
                with torch.no_grad():  # NaN or Inf iff an element is (or |sum| > 3.4e38)
                    self._seen.append((position, local.detach().sum(dtype=torch.float32)))
            except Exception as exc:  # noqa: BLE001 - counted, never raised into the backward
                self._on_error("grads", exc)

        return check

    def take(self) -> torch.Tensor | None:
        """This step's per-block sums of the output gradients (a float32 device vector, one
        per block, micro-steps added up; non-finite: that block's output gradient was), or
        None when no block's output gradient was seen. Three device ops, no host read."""
        seen, self._seen = self._seen, []
        if not seen:
            return None
        sums = torch.stack([value for _, value in seen])
        order = tuple(position for position, _ in seen)
        if self._index is None or self._index[0] != order or self._index[1].device != sums.device:
            index = torch.tensor(order, dtype=torch.long)
            if sums.device.type == "cuda":  # pinned and non-blocking: no wait for the stream
                index = index.pin_memory()
            self._index = order, index.to(sums.device, non_blocking=True)
        flags = torch.zeros(len(self.names), dtype=torch.float32, device=sums.device)
        return flags.index_add_(0, self._index[1], sums)

    def first(self, values: Sequence[float] | None) -> tuple[str, int] | None:
        """``(block name, depth)`` of the block nearest the loss whose output gradient was
        non-finite (depth 0: the last block, the one nearest the loss), or None."""
        if not values or len(values) != len(self.names):
            return None
        for position in range(len(values) - 1, -1, -1):
            if not math.isfinite(values[position]):
                return self.names[position], len(values) - 1 - position
        return None

    def mark(self, record: Any, values: Sequence[float] | None) -> None:
        """Put the entry block on a record whose local gradients were non-finite."""
        entry = self.first(values) if record.local_nonfinite else None
        if entry is not None:
            record.entry_block, record.entry_depth = entry


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, list | tuple):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None
