"""Which non-finite gradient is the origin: the first one in *backward order*.

A NaN that enters the backward pass at some module flows on into every module farther from the
loss, so at the end of the step all of their gradients are non-finite. The tensor where it
began is the one nearest the loss among the non-finite ones: the first to become ready in
backward. The first in module (registration) order would name the far end (the embedding).

The order is measured once: at attach, each trainable parameter gets a one-shot
``register_post_accumulate_grad_hook`` that notes its position when its gradient is ready
(autograd's ``AccumulateGrad`` for plain, DDP, TP and DeepSpeed parameters). Under FSDP2 the
leaf autograd accumulates into is the unsharded parameter, which exists from the first forward
on: the FSDP2 source hooks it then (``watch_one``), at the end of the first forward. Without it
only the sharded parameters' hooks remain, which FSDP2 runs after each unit's reduction (the
root unit's last of all); the source then declares each unit's parameters ``together``: ready
at once, ranked among themselves in reverse registration order.
The first step that ends settles the order and removes the hooks: nothing runs per step after
that, and no device value is ever read. Parameters not seen (no gradient in that backward, or
an engine that assigns gradients another way) follow the seen ones in reverse registration
order, which is also the whole order until the first step ends (and where hooks cannot be
registered): the order DDP uses for its buckets before it has measured one.

Every strategy asks :meth:`BackwardOrder.first` (through ``probes.grads.summarize_host`` and
the pipeline-parallel stage origin), so the choice is made in this one place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger("ddpmon")


class BackwardOrder:
    """Rank of each ``ParamIndex`` position in backward order (0: ready first)."""

    def __init__(self, count: int) -> None:
        self.rank: list[int] = list(range(count - 1, -1, -1))
        """Position -> its place in backward order; replaced whole (readers on the record thread
        take one reference), never mutated."""
        self.rank_array = np.asarray(self.rank, dtype=np.int64)
        self.measured = False
        """True once a backward pass has been seen and the order comes from it."""
        self._count = count
        self._seen: list[int] = []
        self._seen_set: set[int] = set()
        self._handles: list[Any] = []
        self._together: list[frozenset[int]] = []
        self._lock = threading.Lock()

    def together(self, positions: Iterable[int]) -> None:
        """These gradients become ready at once (one FSDP2 unit, whose hooks FSDP2 runs in
        registration order after the unit's reduction): among themselves they are ranked in
        reverse registration order, the module nearest the loss first."""
        block = frozenset(positions)
        if len(block) > 1:
            self._together.append(block)

    def apart(self) -> None:
        """Forget the ``together`` blocks: their parameters are measured one by one after all."""
        self._together = []

    def watch(self, params: Sequence[torch.Tensor],
              on_error: Callable[[str, BaseException], None] | None = None) -> None:
        """One-shot hooks noting the order in which ``params``' gradients become ready."""
        for position, param in enumerate(params):
            try:
                self._handles.append(
                    param.register_post_accumulate_grad_hook(self._noter(position)))
            except Exception as exc:  # a parameter type without the hook: it stays unseen
                if on_error is not None:
                    on_error("grads", exc)
                break

    def watch_one(self, tensor: torch.Tensor, position: int) -> None:
        """One more one-shot hook: ``tensor``'s gradient is ``position``'s (FSDP2's unsharded
        parameter, the leaf autograd accumulates into while its unit computes). Not after the
        order has settled."""
        with self._lock:
            if not self.measured:
                self._handles.append(
                    tensor.register_post_accumulate_grad_hook(self._noter(position)))

    def _noter(self, position: int) -> Callable[[torch.Tensor], None]:
        def note(_param: torch.Tensor) -> None:
            if position not in self._seen_set:
                self._seen_set.add(position)
                self._seen.append(position)

        return note

    def settle(self) -> None:
        """End of the first step: fix the order from what the hooks saw, remove them. Cheap
        (one attribute check) on every later call."""
        if not self._handles or not self._seen:  # settled, or no backward seen yet
            return
        self.close()
        with self._lock:
            seen = set(self._seen)
            rest = [p for p in range(self._count - 1, -1, -1) if p not in seen]
            order = [*self._seen, *rest]
            for block in self._together:
                places = [i for i, p in enumerate(order) if p in block]
                for place, position in zip(places, sorted(block, reverse=True), strict=True):
                    order[place] = position
            rank = [0] * self._count
            for place, position in enumerate(order):
                rank[position] = place
            self.rank_array = np.asarray(rank, dtype=np.int64)
            self.rank = rank
            self.measured = True
            self._seen, self._seen_set = [], set()

    def close(self) -> None:
        """Remove the hooks if no step ended since ``watch`` (the order stays as it is)."""
        with self._lock:
            handles, self._handles = self._handles, []
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass

    def first(self, positions: Iterable[int]) -> int:
        """The position among ``positions`` that is first in backward order (-1: none)."""
        rank = self.rank
        best, best_rank = -1, None
        for pos in positions:
            r = rank[pos] if 0 <= pos < len(rank) else len(rank)
            if best_rank is None or r < best_rank:
                best, best_rank = pos, r
        return best

    def names(self, names: Sequence[str]) -> list[str]:
        """``names`` (by position) in backward order, for the manifest and tests."""
        rank = self.rank
        return [names[p] for p in sorted(range(len(names)), key=lambda p: rank[p])]


__all__ = ["BackwardOrder"]
