"""Timing of the collectives DeepSpeed's ZeRO optimizers issue through ``deepspeed.comm``.

The module functions ZeRO calls (``dist.<op>`` is looked up at call time) are wrapped while a
source is attached and restored at close; each call goes through the source's
``CollectiveRecorder`` (wall time on CPU, events on GPU, async handles at completion).
DeepSpeed's ``comms_logger`` is never used: it synchronises after every op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ...probes.comm import CollectiveRecorder, tensor_bytes

__all__ = ["CommTimer"]

_DS_OPS = {
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "reduce_scatter_fn": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
}
"""``deepspeed.comm`` function -> ``op``. The package attributes are wrapped: ZeRO modules call
``dist.<name>`` on the package, while ``reduce_scatter_fn`` and ``allgather_fn`` call the
underlying function from ``deepspeed.comm.comm``'s own globals, so nothing is counted twice."""


_FULL_BUFFER_ARG = {"all_gather_into_tensor": 0, "allgather_fn": 0}
"""Functions whose bytes are the (gathered) output, their first argument; for the others the
buffer is the input: ``tensor`` (all-reduce, reduce), the second argument (reduce-scatter)."""


def _ds_bytes(name: str, args: tuple, kwargs: dict) -> int:
    if name in _FULL_BUFFER_ARG:
        value = args[0] if args else kwargs.get("output_tensor")
    elif name in ("all_reduce", "reduce", "broadcast"):
        value = args[0] if args else kwargs.get("tensor")
    elif name == "all_gather":
        value = args[0] if args else kwargs.get("tensor_list")
    elif name == "reduce_scatter":
        value = args[1] if len(args) > 1 else kwargs.get("input_list")
    else:  # reduce_scatter_fn, reduce_scatter_tensor: (output, input)
        value = args[1] if len(args) > 1 else kwargs.get("tensor")
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(t) for t in value)
    return tensor_bytes(value)


class CommTimer:
    """Times the ``deepspeed.comm`` collectives (see the module doc) into the recorders of the
    attached sources. One set of wrappers per process, installed with the first source and
    restored (where still ours) when the last one closes."""

    _recorders: ClassVar[list[CollectiveRecorder]] = []
    _originals: ClassVar[dict[str, Callable]] = {}

    def __init__(self, recorder: CollectiveRecorder) -> None:
        self.recorder = recorder
        cls = type(self)
        if not cls._recorders:
            cls._install()
        cls._recorders.append(recorder)

    @classmethod
    def _install(cls) -> None:
        import deepspeed.comm as dscomm  # optional: ddpmon[deepspeed]

        for name, op in _DS_OPS.items():
            original = getattr(dscomm, name, None)
            if not callable(original):
                continue
            cls._originals[name] = original
            setattr(dscomm, name, cls._wrap(name, op, original))

    @classmethod
    def _wrap(cls, name: str, op: str, original: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            recorders = cls._recorders
            if not recorders:
                return original(*args, **kwargs)
            try:
                nbytes = _ds_bytes(name, args, kwargs)
            except Exception:
                nbytes = 0
            first = recorders[0]
            if len(recorders) == 1:
                return first.call(op, nbytes, original, *args, **kwargs)
            try:
                timer = first.start(_first_arg(args, kwargs))
            except Exception:
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            for rec in recorders:  # several engines in one process: each sees every op
                if result is not None and callable(getattr(result, "get_future", None)):
                    rec.stop_at_completion(op, timer, nbytes, result)
                else:
                    rec.stop(op, timer, nbytes)
            return result

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.ddpmon_comm_timer = True  # type: ignore[attr-defined]
        return timed

    def close(self) -> None:
        cls = type(self)
        if self.recorder in cls._recorders:
            cls._recorders.remove(self.recorder)
        if cls._recorders:
            return
        import deepspeed.comm as dscomm  # optional: ddpmon[deepspeed]

        for name, original in cls._originals.items():
            current = getattr(dscomm, name, None)
            if getattr(current, "ddpmon_comm_timer", False):
                setattr(dscomm, name, original)
            # else: someone wrapped it after us; leave their wrapper (ours is then inert)
        cls._originals.clear()


def _first_arg(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None
