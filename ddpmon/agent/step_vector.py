"""The per-step device vector: named slots declared once, pack and unpack derived from them.

Each step the flow hands over a tensor per slot (or None: absent this step). On CUDA the
present slots are concatenated into one float64 vector on the training thread, copied to the
host lazily (``readback.Readback``), and split back by name with the widths recorded at pack
time. On CPU no vector is built: the tensors are queued as they are and packed into a host list
when the record thread drains them. Adding a measurement is one ``Slot`` in ``STEP_SLOTS``, or,
for one strategy's own, in its source's ``extra_slots``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..host_reads import host_read_free
from ..metrics import step_slots as names
from ..metrics.step_slots import Slot

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
    Slot(names.UPDATE_SQUARES, None, "per-parameter squared weight/update/moment norms "
         "(sampled steps, probes.updates)"),
    Slot(names.LOGIT_MAX, None, "the named modules' largest outputs (probes.logits)"),
    Slot(names.ENTRY_BLOCKS, None, "tensor parallel: per top-level block, the sum of its output "
         "gradient (non-finite: where a NaN entered this rank, strategies.block_entry)"),
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
        self,
        values: Mapping[str, torch.Tensor | None],
        on_unreadable: Callable[[str, Exception], None] | None = None,
    ) -> tuple[torch.Tensor | list[float] | None, Packed]:
        """One float64 device vector (or, on CPU, the host values) plus its ``Packed`` key.

        With ``on_unreadable``, a slot whose value cannot be read (a tensor subclass, a wrong
        width) is left out alone and handed to it; the step's other slots stay. Without it,
        that raises."""
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
            try:
                flat = _flat(slot, t)
            except Exception as exc:
                if on_unreadable is None:
                    raise
                on_unreadable(slot.name, exc)
                continue
            names.append(slot.name)
            widths.append(len(flat) if isinstance(flat, list) else flat.numel())
            pieces.append(flat)  # type: ignore[arg-type]
        key = Packed(tuple(names), tuple(widths))
        if not pieces:
            return None, key
        device = next((p.device for p in pieces
                       if isinstance(p, torch.Tensor) and not host_read_free(p.device)), None)
        if device is None:  # host memory already: no device vector, no copy to wait for
            out: list[float] = []
            for p in pieces:
                out.extend(p)  # type: ignore[arg-type]
            return out, key
        return torch.cat([_on(p, device) for p in pieces]), key

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


def _flat(slot: Slot, tensor: torch.Tensor) -> torch.Tensor | list[float]:
    """One slot's values, flat: a host list where a host read is free (read now: it is host
    memory; ``host_reads``), a plain device tensor otherwise. Raises for a value that cannot be
    read back (a DTensor or another wrapper subclass: ``.tolist()`` is not supported for tensor
    subclasses)."""
    flat = tensor.detach().reshape(-1)
    if slot.width is not None and flat.numel() != slot.width:
        raise ValueError(f"slot {slot.name}: width {flat.numel()}, expected {slot.width}")
    if host_read_free(flat.device):
        return flat.tolist()
    if type(flat) is not torch.Tensor:
        raise TypeError(f"slot {slot.name}: a {type(flat).__name__} cannot be read back")
    return flat


def _on(piece: torch.Tensor | list[float], device: torch.device) -> torch.Tensor:
    if isinstance(piece, list):
        return torch.tensor(piece, dtype=torch.float64, device=device)
    return piece.to(device, torch.float64, non_blocking=True)
