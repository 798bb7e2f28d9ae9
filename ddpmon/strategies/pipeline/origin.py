"""Where a non-finite value first appeared under pipeline parallel, decided per stage on the
record thread from the stage probes' flags (``probes.StageProbes``) and the local norms.

A stage is the origin when its weights entering the step were finite and the first non-finite
thing it touched was something it *produced* (an activation it sent, its output, an activation
gradient it sent, a parameter gradient), not something it *received*. An applied step with a
non-finite global norm poisons every stage: no later step can be an origin.
"""

from __future__ import annotations

import math
from typing import Any

from ...probes.grads import ParamIndex
from .probes import NO_EVENT, PARAM_GRAD_SEQ, PP_FLAGS, PPStep


def stage_positions(names: list[str]) -> list[int]:
    """Stage index of each parameter (names start with ``stage<k>.``; -1 otherwise)."""
    out = []
    for name in names:
        head = name.split(".", 1)[0]
        out.append(int(head[5:]) if head.startswith("stage") and head[5:].isdigit() else -1)
    return out


class StageOrigin:
    def __init__(self, index: ParamIndex) -> None:
        self.index = index
        self._stage_of = stage_positions(index.names)
        self._poisoned: set[int] = set()

    def finish(self, record: Any, parts: dict, step: PPStep, local, reduced) -> None:
        """The origin per stage (see the module doc); the global norm over every stage is
        ``PPStep.global_norm``'s, already in ``record``. Record thread. ``local``/``reduced``:
        (host values, positions) or None."""
        flags = parts.get(PP_FLAGS.name, [])
        stage_bad_local = self._bad_stages(local)
        stage_bad_reduced = self._bad_stages(reduced)
        origin_where = None
        touched = False
        poisoned = False
        for k, index in enumerate(step.stages):
            recv = flags[2 * k] if 2 * k < len(flags) else NO_EVENT
            prod = flags[2 * k + 1] if 2 * k + 1 < len(flags) else NO_EVENT
            bad_param = stage_bad_local.get(index)
            if bad_param is not None:
                prod = min(prod, PARAM_GRAD_SEQ)
            if prod == NO_EVENT and recv == NO_EVENT:
                continue
            touched = True
            if index in self._poisoned:
                poisoned = True
                continue
            if prod < recv and origin_where is None:
                if prod >= PARAM_GRAD_SEQ:
                    where = {"stage": index, "microbatch": None, "site": "param_grad"}
                else:
                    _, mb, site = step.table[int(prod)]
                    where = {"stage": index, "microbatch": mb, "site": site}
                origin_where = where | {"param": bad_param}
        if (record.grad_nonfinite or stage_bad_reduced) and record.skipped_by is None:
            # An applied step with a non-finite global norm: every stage's weights are suspect
            # from now on (clipping by that norm, as torchtitan does, multiplies every stage's
            # gradients by NaN), so no later step can be an origin, as under DDP.
            self._poisoned.update(step.stages)
        record.pp_origin = origin_where
        record.origin = origin_where is not None
        record.poisoned = touched and not record.origin and poisoned
        record.origin_decided = True
        if touched:
            record.local_nonfinite = True
            if origin_where is not None:
                record.local_nonfinite_param = origin_where["param"] or (
                    f"stage{origin_where['stage']}.<{origin_where['site']}>"
                )
            elif record.local_nonfinite_param is None:
                record.local_nonfinite_param = next(
                    (p for p in stage_bad_local.values() if p), None
                )
            record.local_nonfinite_kind = record.local_nonfinite_kind or "nan"

    def _bad_stages(self, host) -> dict[int, str | None]:
        """Stage -> first non-finite parameter name, from (host values, positions)."""
        out: dict[int, str | None] = {}
        if host is None:
            return out
        values, positions = host
        rank = self.index.order.rank  # first in backward order first (probes.backward_order)
        bad = sorted((p for v, p in zip(values, positions, strict=True) if not math.isfinite(v)),
                     key=lambda p: rank[p] if 0 <= p < len(rank) else len(rank))
        for pos in bad:
            stage = self._stage_of[pos] if 0 <= pos < len(self._stage_of) else -1
            if stage not in out:
                out[stage] = self.index.name(pos)
        return out

    def reset(self) -> None:
        """No stage poisoned (a new attempt)."""
        self._poisoned.clear()
