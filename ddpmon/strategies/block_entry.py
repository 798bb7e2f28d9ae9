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
the output's ``grad_fn``; in backward it runs ``isfinite().all()`` on this rank's local piece of
that gradient and ORs the flag into a per-step device vector (one entry per block): three small
device ops per block and micro-batch, no host read. The vector is one slot of the step vector
(``ENTRY_BLOCKS``), read back lazily with the step's other values. A ``grad_fn`` pre-hook runs
after every hook registered on the tensor itself (autograd runs tensor hooks first), so the flag
is the gradient autograd goes on with, whoever changed it. Installed for the TP strategies only,
where the parameters cannot tell (``tp``, ``fsdp2+tp``, ``hsdp+tp``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .dtensor_norms import is_dtensor

__all__ = ["BlockEntry", "tensor_parallel", "top_level_blocks"]


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
        self._lock = threading.Lock()
        self._flags: torch.Tensor | None = None
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
            if not self.enabled or not torch.is_grad_enabled():
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
            if not self.enabled:
                return
            try:
                grad = grad_outputs[output_nr] if output_nr < len(grad_outputs) else None
                if grad is None:
                    return
                local = grad.to_local() if is_dtensor(grad) else grad
                with torch.no_grad():
                    bad = torch.isfinite(local.detach()).all().logical_not()
                    self._note(position, bad)
            except Exception as exc:  # noqa: BLE001 - counted, never raised into the backward
                self._on_error("grads", exc)

        return check

    def _note(self, position: int, bad: torch.Tensor) -> None:
        with self._lock:
            flags = self._flags
            if flags is None or flags.device != bad.device:
                flags = self._flags = torch.zeros(len(self.names), dtype=torch.bool,
                                                  device=bad.device)
            flags[position] |= bad

    def take(self) -> torch.Tensor | None:
        """This step's flags (a device bool vector, one per block; None: no block's output
        gradient was seen). A fresh vector starts with the next backward."""
        with self._lock:
            flags, self._flags = self._flags, None
        return flags

    def first(self, values: Sequence[float] | None) -> tuple[str, int] | None:
        """``(block name, depth)`` of the block nearest the loss whose output gradient was
        non-finite (depth 0: the last block, the one nearest the loss), or None."""
        if not values or len(values) != len(self.names):
            return None
        for position in range(len(values) - 1, -1, -1):
            if values[position]:
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
