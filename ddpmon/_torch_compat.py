"""Every private torch API ddpmon reaches, behind one door.

Each access is guarded and has a fallback: a torch that renamed or removed it keeps training,
the fast path or the feature is lost, and ``lost`` says so once per access with the torch
version (``LOST`` counts them for ``mon.state`` readers and the tests). Nothing here raises
into a training loop. ``tests/unit/test_torch_compat.py`` holds a test per access that fails
when the torch in use no longer has it, so an upgrade is noticed in CI, not by a user.

Outside this module ruff's SLF001 (private member access) is on; pyproject.toml lists the few
justified exceptions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _python_dispatch

log = logging.getLogger("ddpmon")

LOST: Counter[str] = Counter()
"""Access name -> how often its fallback ran (each access warns once)."""


def lost(access: str, consequence: str) -> None:
    """The torch in use lacks ``access``: warn once, count every time."""
    LOST[access] += 1
    if LOST[access] == 1:
        log.warning("ddpmon: torch %s has no %s; %s", torch.__version__, access, consequence)


# ------------------------------------------------------------------------- autograd engine
def queue_backward_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward pass ends (the autograd engine's
    ``queue_callback``, reachable only as ``Variable._execution_engine``). Queued from inside
    backward, twice, so that it runs after every callback queued earlier (DDP's, FSDP's).
    False, and nothing queued, where the engine is unreachable: the step's gradients are then
    collected at the optimizer step."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        lost("Variable._execution_engine.queue_callback",
             "gradients are collected at the optimizer step, not at the end of backward")
        return False
    queue(lambda: queue(callback))
    return True


# ------------------------------------------------------------------------- tensors
def version(tensor: torch.Tensor) -> int:
    """The in-place version counter (``Tensor._version``): host metadata, no device sync. -1
    where a torch lacks it (a stamp built from it then never matches, so nothing is reused)."""
    value = getattr(tensor, "_version", None)
    if not isinstance(value, int):
        lost("Tensor._version", "a measured norm is never reused for clipping")
        return -1
    return value


def foreach_sub_(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``tensors[i] -= others[i]`` in one fused multi-tensor call (``torch._foreach_sub_``), one
    ``sub_`` per tensor where it is missing."""
    fused = getattr(torch, "_foreach_sub_", None)
    if fused is not None:
        fused(tensors, others)
        return
    lost("torch._foreach_sub_", "updates are subtracted one tensor at a time")
    for mine, other in zip(tensors, others, strict=True):
        mine.sub_(other)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> Any:
    """One fused multi-tensor L2 norm (``torch._foreach_norm``), accumulated in ``dtype``;
    ``vector_norm`` per tensor where the fused kernel or its ``dtype`` argument is missing."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        try:
            return fused(tensors, 2, dtype=dtype) if dtype else fused(tensors, 2)
        except TypeError:  # a torch without the dtype argument
            pass
        except RuntimeError:  # tensors the fused kernel refuses (mixed devices): per tensor
            return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]
    lost("torch._foreach_norm(dtype=)", "norms are computed one tensor at a time")
    return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


# ------------------------------------------------------------------------- DTensor
def dtensor_local(tensor: Any) -> torch.Tensor:
    """A DTensor's own piece as it holds it: ``_local_tensor``, without ``to_local``'s autograd
    function (~4 us of Python per parameter and step); ``to_local()`` where it is missing."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    lost("DTensor._local_tensor", "to_local() is used instead, a few microseconds per "
         "parameter and step (numbers are unchanged)")
    return tensor.to_local()


def dtensor_placements(tensor: Any) -> tuple:
    """A DTensor's placements from its ``_spec`` (without the property's lookup); the public
    ``placements`` where it is missing."""
    spec = getattr(tensor, "_spec", None)
    if spec is not None:
        return spec.placements  # a tuple already: no copy per parameter and step
    lost("DTensor._spec", "the placements property is used instead (numbers are unchanged)")
    return tuple(tensor.placements)


# ------------------------------------------------------------------------- GradScaler
def scaler_state(scaler: Any, optimizer: Any) -> dict | None:
    """``GradScaler``'s per-optimizer state this step (``_per_optimizer_states``): its stage
    (unscaled yet?) and ``found_inf_per_device``. None where unreadable: the scaler's skips and
    ``unscale_`` are then not seen."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        lost("GradScaler._per_optimizer_states",
             "the scaler's skipped steps and unscale_ calls are not seen")
        return None
    state = states[id(optimizer)]
    return state if isinstance(state, dict) else None


# ------------------------------------------------------------------------- FSDP2
def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one module (``_get_fsdp_state()._fsdp_param_groups``; one
    ``_fsdp_param_group`` in older torch); [] where unreadable (its reduce-scatter input, the
    local norms, is then not probed)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        lost("FSDPModule._get_fsdp_state", "FSDP2's pre-reduction gradients are not probed")
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group at most
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def set_all_reduce_hook(group: Any, hook: Any) -> None:
    """Restore a parameter group's HSDP all-reduce hook (``_all_reduce_hook``; the public
    ``set_all_reduce_hook`` refuses None, which is what most groups had)."""
    if not hasattr(group, "_all_reduce_hook"):
        lost("FSDPParamGroup._all_reduce_hook", "a user's all-reduce hook is not restored")
        return
    group._all_reduce_hook = hook


# ------------------------------------------------------------------------- pipelining
def batch_p2p() -> Callable | None:
    """``torch.distributed.pipelining.schedules._batch_p2p``, the one call every schedule sends
    and receives through; None where it is missing (PP send/recv are then not timed)."""
    from torch.distributed.pipelining import schedules  # guarded: an API some torch builds lack

    found = getattr(schedules, "_batch_p2p", None)
    if found is None:
        lost("pipelining.schedules._batch_p2p", "pipeline sends and receives are not timed")
    return found


def set_batch_p2p(function: Callable) -> None:
    """Install ``function`` as ``schedules._batch_p2p`` (process-wide: every schedule)."""
    from torch.distributed.pipelining import schedules  # guarded: an API some torch builds lack

    schedules._batch_p2p = function


def _read(obj: Any, name: str, access: str, consequence: str, default: Any = None) -> Any:
    """``obj.<name>`` where the torch object has it; else ``default``, and ``lost`` says so."""
    if hasattr(obj, name):
        return getattr(obj, name)
    lost(access, consequence)
    return default


# ------------------------------------------------------------------------- GradScaler fields
def scaler_enabled(scaler: Any) -> bool:
    """``GradScaler._enabled`` (``is_enabled()`` is public but not on every scaler class that
    Lightning and Accelerate hand over); True where missing, as a scaler is by default."""
    return bool(_read(scaler, "_enabled", "GradScaler._enabled",
                      "a disabled scaler counts as enabled", True))


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The scale tensor in use, on its device (``GradScaler._scale``: ``get_scale()`` would read
    it on the host, a device sync per step). None where missing or not yet created: norms seen
    inside backward are then reported scaled."""
    scale = _read(scaler, "_scale", "GradScaler._scale",
                  "norms measured inside backward are not unscaled")
    return scale if isinstance(scale, torch.Tensor) else None


# ------------------------------------------------------------------------- torch.compile
def compiled_inner(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper compiled (``OptimizedModule._orig_mod``), or None
    for any other module (parameter names are then the wrapper's, ``_orig_mod.``-prefixed)."""
    return getattr(model, "_orig_mod", None)


# ------------------------------------------------------------------------- pipelining
def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a pipeline schedule drives on this rank (``_stages``, or one ``_stage``)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        if stage is None:
            lost("PipelineSchedule._stages", "the schedule's stages cannot be found (attach "
                 "says why)")
        stages = [stage] if stage is not None else []
    return list(stages)


def schedule_microbatches(schedule: Any) -> int:
    """``PipelineSchedule._n_microbatches``; 1 where missing (micro-batch local norms are then
    not divided by it)."""
    return int(_read(schedule, "_n_microbatches", "PipelineSchedule._n_microbatches",
                     "local norms are not divided by the micro-batch count", 1) or 1)


# ------------------------------------------------------------------------- FSDP2 group
def fsdp_group_comms(group: Any) -> tuple[Any, Any, Any, bool]:
    """A parameter group's reduce-scatter and all-gather comms, its all-reduce hook (None where
    the user set none) and whether it is HSDP: the pieces ddpmon wraps and restores."""
    return (getattr(group, "_reduce_scatter_comm", None), getattr(group, "_all_gather_comm", None),
            getattr(group, "_all_reduce_hook", None), bool(getattr(group, "_is_hsdp", False)))


def fsdp_reduce_scatter_group(group: Any) -> Any:
    """The process group a parameter group's reduce-scatter runs over (its ``mesh_info``'s
    dedicated reduce-scatter group, else the shard group); None where unreadable or where
    FSDP2 shards nothing (``replicate``). FSDP2 skips the reduce-scatter when it has one rank."""
    info = getattr(group, "mesh_info", None)
    if info is None:
        lost("FSDPParamGroup.mesh_info", "a one-rank FSDP2 mesh is not told apart")
        return None
    return (getattr(info, "reduce_scatter_process_group", None)
            or getattr(info, "shard_process_group", None))


def fsdp_mp_policy(model: torch.nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` of ``model``'s FSDP2 root (its first parameter group's
    ``mp_policy``), None without FSDP2 or where unreadable (precision is then the parameters'
    dtype)."""
    try:
        from torch.distributed.fsdp import FSDPModule  # guarded: an API some torch builds lack
    except ImportError:
        return None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                policy = getattr(group, "mp_policy", None)
                if policy is not None:
                    return policy
    return None


def fsdp_unsharded_param(fsdp_param: Any) -> torch.Tensor | None:
    """An ``FSDPParam``'s unsharded parameter (``_unsharded_param``: the leaf autograd
    accumulates into in backward), None before its first all-gather or where unreadable (the
    origin's backward order then comes from the units' reduction order)."""
    found = getattr(fsdp_param, "_unsharded_param", None)
    if found is None and not hasattr(type(fsdp_param), "unsharded_param"):
        lost("FSDPParam._unsharded_param",
             "the origin's backward order under FSDP2 is by unit, not by parameter")
    return found if isinstance(found, torch.Tensor) else None


# ------------------------------------------------------------------------- flight recorder
def flight_recorder_dumps() -> tuple[Callable | None, Callable | None]:
    """c10d's flight-recorder dump functions (pickle, JSON): ``_dump_fr_trace`` (``_nccl_`` in
    older torch). (None, None) where this build has neither: stalls then carry no dump."""
    try:
        from torch._C import _distributed_c10d as c10d  # guarded: an API some torch builds lack
    except ImportError:
        return None, None
    dump_pickle = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    dump_json = (getattr(c10d, "_dump_fr_trace_json", None)
                 or getattr(c10d, "_dump_nccl_trace_json", None))
    return dump_pickle, dump_json


def flight_recorder_state() -> dict | None:
    """This process's flight recorder as JSON (every group's sequence status and its recent
    collectives, ``_dump_fr_trace_json(include_collectives, only_active)``); None where this
    build has no recorder. Safe from a thread while the training thread waits in a collective."""
    _, dump_json = flight_recorder_dumps()
    if dump_json is None:
        return None
    data = json.loads(bytes(dump_json(True, True)))
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------- DCP
def dcp_logger() -> logging.Logger | None:
    """DCP's own logger (``torch.distributed.checkpoint.logger._dcp_logger``), once DCP is
    imported; None before, or where a torch lacks it (DCP saves are then not captured)."""

    module = sys.modules.get("torch.distributed.checkpoint.logger")
    if module is None:
        return None
    target = getattr(module, "_dcp_logger", None)
    if not isinstance(target, logging.Logger):
        lost("checkpoint.logger._dcp_logger", "DCP saves and loads are not captured")
        return None
    return target


def raw_flop_formula(fn: Any) -> Any:
    """Mark ``fn`` as a FLOP formula that takes an op's raw arguments (tensors, DTensors), not
    their shapes: ``FlopCounterMode(custom_mapping=...)`` reads the private ``_get_raw`` flag
    (torch >= 2.4; an older torch passes shapes, and the formulas then count nothing)."""
    fn._get_raw = True  # noqa: SLF001 - the one door to this torch flag
    return fn


def exit_dispatch_mode(mode: Any, leave: Callable[[], Any]) -> None:
    """``leave()`` (a dispatch mode's ``__exit__``, which pops the top of the mode stack) with
    ``mode`` on top: modes entered above it since (a user's, still open) are popped for the
    call and pushed back in their order. Raises RuntimeError when ``mode`` is not on the stack
    (leaving would pop another's mode)."""
    dispatch = _python_dispatch
    if not any(m is mode for m in dispatch._get_current_dispatch_mode_stack()):
        raise RuntimeError("the FLOP counter's dispatch mode left the mode stack")
    with contextlib.ExitStack() as above:
        while dispatch._get_current_dispatch_mode() is not mode:
            above.enter_context(dispatch._pop_mode_temporarily())
        leave()
