"""The per-step device vector: named slots declared once, pack and unpack derived from them.

Each step the pipeline hands over a tensor per slot (or None: absent this step). On CUDA the
present slots are concatenated into one float64 vector on the training thread, copied to the
host lazily (``readback.Readback``), and split back by name with the widths recorded at pack
time. On CPU no vector is built: the tensors are queued as they are and packed into a host list
when the record thread drains them. Adding a measurement is one ``Slot`` in ``STEP_SLOTS``, or,
for one strategy's own, in its source's ``extra_slots``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import step_slots as names
from ..host_reads import host_read_free
from ..step_slots import Slot

__all__ = ["STEP_SLOTS", "Packed", "Slot", "StepVectorLayout"]


STEP_SLOTS: tuple[Slot, ...] = (
    Slot(names.REDUCED_NORMS, None, "per-parameter norms of the global gradients"),
    Slot(names.LOCAL_NORMS, None, "per-parameter norms of this rank's pre-reduction gradients"),
    Slot(names.LOSS, 1, "the loss given to observe_loss"),
    Slot(names.GRAD_SCALE, 1, "the loss scale the measured gradients carried"),
    Slot(names.LOSS_SCALE, 1, "the GradScaler's scale after its update"),
    Slot(names.FOUND_INF, 1, "the GradScaler found Inf/NaN and skipped the step"),
    Slot(names.IDENTICAL_RANKS, 1, "other ranks whose local gradients were bit-identical"),
    Slot(names.TRAINER_NORM, 1, "the grad norm a trainer reported, to cross-check"),
)
"""The slots every strategy fills; a source adds its own (``GradientSource.extra_slots``)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """Which slots a packed vector holds, and their widths, in order."""

    names: tuple[str, ...]
    widths: tuple[int, ...]


class StepVectorLayout:
    def __init__(self, slots: Sequence[Slot] = STEP_SLOTS) -> None:
        self.slots = tuple(slots)
        self._by_name = {s.name: s for s in self.slots}
        if len(self._by_name) != len(self.slots):
            raise ValueError("duplicate slot names")

    def pack(
        self, values: Mapping[str, torch.Tensor | None]
    ) -> tuple[torch.Tensor | list[float] | None, Packed]:
        """One float64 device vector (or, on CPU, the host values) plus its ``Packed`` key."""
        unknown = set(values) - set(self._by_name)
        if unknown:
            raise KeyError(f"unknown step-vector slot(s): {sorted(unknown)}")
        names: list[str] = []
        widths: list[int] = []
        pieces: list[torch.Tensor] = []
        for slot in self.slots:
            t = values.get(slot.name)
            if t is None:
                continue
            flat = t.detach().reshape(-1)
            if slot.width is not None and flat.numel() != slot.width:
                raise ValueError(f"slot {slot.name}: width {flat.numel()}, expected {slot.width}")
            names.append(slot.name)
            widths.append(flat.numel())
            pieces.append(flat)
        key = Packed(tuple(names), tuple(widths))
        if not pieces:
            return None, key
        device = next((p.device for p in pieces if not host_read_free(p.device)), None)
        if device is None:  # host memory already: no device vector, no copy to wait for
            out: list[float] = []
            for p in pieces:
                out.extend(p.tolist())
            return out, key
        return torch.cat([p.to(device, torch.float64, non_blocking=True) for p in pieces]), key

    @staticmethod
    def unpack(values: Sequence[float], key: Packed) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        pos = 0
        for name, width in zip(key.names, key.widths, strict=True):
            out[name] = list(values[pos : pos + width])
            pos += width
        if pos != len(values):
            raise ValueError(f"step vector has {len(values)} values, layout says {pos}")
        return out
