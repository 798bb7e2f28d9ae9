"""The update probe (``probes.updates``) on DeepSpeed ZeRO 1-3: the fp32 master partitions the
ZeRO optimizer steps, this rank's disjoint slice of every parameter, summed over the
data-parallel group.

Why not the module's parameters: ZeRO-1/2 step a flat fp32 copy partitioned over the ranks and
gather the result into the module afterwards (bf16/fp16: a rounded copy); ZeRO-3 keeps only a
partition of each parameter. The update the optimizer made, and its moments, live in the
partitions; the optimizer's ``state`` is indexed by the flat partitions.

DeepSpeed's own attributes read (version-fragile; a failure is counted under ``updates``):

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``single_partition_of_fp32_groups[g]`` (the flat fp32
  partition of param group ``g``) and each parameter's ``_hp_mapping`` (``param_group_index``,
  ``hp_fragment_address``: where its fragment lies in that partition; None where this rank owns
  none of it), the same mapping ``deepspeed.utils.safe_get_full_fp32_param`` reads;
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``fp32_partitioned_groups_flat[g]`` and
  ``grad_position[get_param_id(p)] = (g, offset, numel)``, what its ``get_local_fp32_param``
  narrows, without that method's stream synchronisation;
- both: ``optimizer.optimizer`` (the torch optimizer; its ``state[flat]`` holds the moments) and
  ``dp_process_group``.

The ZeRO optimizer's ``step`` is wrapped on the instance (the engine calls it at accumulation
boundaries only): the copy before, the measure after, whether DeepSpeed applied or skipped the
step (skipped: an update of 0). Not measured: NVMe-swapped optimizer state (the partitions are
not in memory) and DeepSpeed's ``BF16_Optimizer``/``FP16_Optimizer`` wrappers (other layouts).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .grads import ParamIndex
from .update_pieces import Piece, Pieces, keeps_moments
from .updates import UpdateProbe

log = logging.getLogger("ddpmon")


class ZeroPieces(Pieces):
    """This rank's fp32 master partitions and each indexed parameter's piece of them."""

    def __init__(self, zero: Any, stage: int, index: ParamIndex) -> None:
        self.optimizer = zero
        self.params = list(index.params)
        self.stage = stage
        self.moments = keeps_moments(zero.optimizer)
        self.layout = zero3_layout(zero, index) if stage == 3 else zero12_layout(index)

    def sources(self) -> list[torch.Tensor]:
        groups = (self.optimizer.fp32_partitioned_groups_flat if self.stage == 3
                  else self.optimizer.single_partition_of_fp32_groups)
        return [flat.detach() for flat in groups]

    def state(self) -> tuple[Any, list[Any]]:
        groups = (self.optimizer.fp32_partitioned_groups_flat if self.stage == 3
                  else self.optimizer.single_partition_of_fp32_groups)
        return self.optimizer.optimizer.state, list(groups)

    def copy_bytes(self) -> int:
        """The flat partitions' bytes: the same on every rank (DeepSpeed pads them alike)."""
        return sum(flat.numel() * flat.element_size() for flat in self.sources())


def zero12_layout(index: ParamIndex) -> list[Piece]:
    """ZeRO-1/2: each parameter's fragment of its group's flat partition, where this rank owns
    one (``_hp_mapping``); a parameter owned elsewhere has no piece here."""
    layout = []
    for pos, p in enumerate(index.params):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue
        address = mapping.hp_fragment_address
        layout.append(Piece(pos, int(mapping.param_group_index), int(address.start),
                            int(address.numel)))
    return layout


def zero3_layout(zero: Any, index: ParamIndex) -> list[Piece]:
    """ZeRO-3: each parameter's partition (padded with zeros on the last rank) in its
    sub-group's flat fp32 partition."""
    layout = []
    for pos, p in enumerate(index.params):
        place = zero.grad_position.get(zero.get_param_id(p))
        if place is None:
            continue
        group, offset, numel = (int(v) for v in place)
        if numel > 0:
            layout.append(Piece(pos, group, offset, numel))
    return layout


def readable(zero: Any, stage: int) -> str | None:
    """Why the update figures cannot be read from this ZeRO optimizer (None: they can)."""
    if stage in (1, 2):
        if not hasattr(zero, "single_partition_of_fp32_groups"):
            return f"{type(zero).__name__} keeps no ZeRO-1/2 fp32 partitions"
    elif stage == 3:
        if not hasattr(zero, "fp32_partitioned_groups_flat") or not hasattr(zero, "grad_position"):
            return f"{type(zero).__name__} keeps no ZeRO-3 fp32 partitions"
        swapped = getattr(zero, "_swappable_optimizer_subgroup", None)
        groups = len(zero.fp32_partitioned_groups_flat)
        if callable(swapped) and any(swapped(g) for g in range(groups)):
            return "the optimizer state is swapped to NVMe"
    else:
        return f"ZeRO stage {stage}"
    if not hasattr(zero, "optimizer") or not hasattr(zero.optimizer, "state"):
        return "no torch optimizer inside the ZeRO optimizer"
    return None


@dataclass(slots=True)
class GroupSum:
    """The SUM of the probe's squares over DeepSpeed's data-parallel group (the partitions are
    disjoint: every piece counts once, no mask)."""

    group: Any
    device: torch.device
    mask: Any = None

    def start(self, vector: torch.Tensor) -> Any:
        return torch.distributed.all_reduce(vector, group=self.group, async_op=True)


class StepWrap:
    """Wraps ``zero.step`` on the instance: the probe's copy before, its measure after a step
    that returned (one that raised is not measured). ``remove()`` restores it (the probe's
    ``close``)."""

    def __init__(self, zero: Any, probe: UpdateProbe) -> None:
        self.zero = zero
        original = zero.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            probe.before_step()
            try:
                result = original(*args, **kwargs)
            except BaseException:
                probe.drop()
                raise
            probe.after_step()
            return result

        self._step = step
        zero.step = step

    def remove(self) -> None:
        if self.zero.__dict__.get("step") is self._step:
            del self.zero.step


def zero_probe(engine: Any, stage: int, index: ParamIndex, every: int,
               step_of: Callable[[], int], on_error: Callable[[str, BaseException], None],
               copy_budget: int) -> UpdateProbe | None:
    """The update probe of a ZeRO 1-3 engine, its step wrapped; None (logged once) where the
    partitions cannot be read (``readable``)."""
    zero = engine.optimizer
    why = readable(zero, stage)
    if why is not None:
        log.warning("ddpmon: update figures off under DeepSpeed: %s", why)
        return None
    group = getattr(zero, "dp_process_group", None)
    device = index.params[0].device if index.params else torch.device("cpu")
    probe = UpdateProbe(zero, index, every, step_of, on_error, GroupSum(group, device),
                        copy_budget=copy_budget, pieces=ZeroPieces(zero, stage, index))
    probe.add_handle(StepWrap(zero, probe))
    return probe


__all__ = ["GroupSum", "StepWrap", "ZeroPieces", "readable", "zero12_layout", "zero3_layout",
           "zero_probe"]
