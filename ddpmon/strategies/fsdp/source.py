"""Gradient source for FSDP2 ``fully_shard``, HSDP and FSDP2 + tensor parallel.

Where each number comes from (why: see the Parallelism section of the docs):

- ``local`` (this rank's gradients before the reduction): a thin wrapper around each unit's
  reduce-scatter, installed with FSDP2's public ``set_custom_reduce_scatter``. Its input is the
  flat buffer FSDP2 builds from this rank's unsharded gradients (accumulated over
  ``set_requires_gradient_sync(False)`` micro-steps, already in the reduce dtype). One fused
  norm pass over it, per (rank row, parameter) slice, gives exact per-parameter norms and the
  origin FQN; it is the only pass over full-size local gradients, run while they are hot.
  On CPU the pass is a fixed handful of calls over precomputed indices (``flat_norms``), and,
  as for DDP, runs every ``local_norm_every`` steps; on the other steps one ``sum`` of the
  buffer (a NaN or Inf anywhere makes it non-finite; about 3x cheaper than the pass) is read on
  the host, free on CPU, and only a non-finite sum runs the norm pass, right there: the origin
  stays exact on every step. A one-rank reduce-scatter group (a size-1 dp
  mesh beside TP, HSDP with a size-1 shard dim) has no reduce-scatter call: its input is seen
  at the allocation of its output (``comms.ProbedReduceScatter.allocate``).
- ``reduced`` (the global pre-clip norm): at ``on_backward_end`` after a backward that reduced,
  one fused norm pass over this rank's sharded gradients (1/shards of the data; on CPU one pass
  per unit over the buffer FSDP2 leaves them in, ``shard_norms``) and one small
  async all-reduce of the per-parameter partial squares over the shard dim(s)
  (``dtensor_norms``), waited on at ``collect``. The user's clipping comes after
  ``on_backward_end``, so the numbers are unclipped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..._torch_compat import (
    dtensor_local,
    fsdp_group_comms,
    fsdp_param_groups,
    fsdp_reduce_scatter_group,
    fsdp_unsharded_param,
    set_all_reduce_hook,
)
from ...probes.grads import per_param_norms
from .. import data_check
from ..base import BatchShare, GradSummaries, NormVector, SourceEnv
from ..dtensor_norms import ShardedNorms
from ..local_sampling import LocalNormSampler
from ..model_parallel import split_degree
from ..registry import detect_sharded, fsdp_modules
from ..replicas import ReplicaScope, tp_replica_scope
from ..sharded_source import ShardedSource
from .comms import (
    AllReduceTimer,
    DefaultAllGather,
    DefaultReduceScatter,
    FSDPUnit,
    ProbedReduceScatter,
    TimedAllGather,
    unit_norms,
)
from .shard_norms import ShardPass

log = logging.getLogger("ddpmon")

# Reduce dtypes FSDP2 does not pre-divide (it pre-divides fp16 to avoid overflow).
_UNSCALED_REDUCE_DTYPES = (torch.float32, torch.bfloat16)
_MAX_PIECES_PER_UNIT = 64


@dataclass(slots=True)
class _LocalPiece:
    norms: torch.Tensor
    positions: list[int]


def _param_groups(module: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one module (private state; [] when unreadable)."""
    return fsdp_param_groups(module)


def _columns(fsdp_param: Any) -> int:
    size = getattr(fsdp_param, "padded_sharded_param_size", None)
    if size is None:
        raise AttributeError("FSDPParam.padded_sharded_param_size")
    return int(torch.Size(size).numel())


class FSDPSource(ShardedSource):
    """FSDP2, HSDP, FSDP2+TP: the parameters' placements decide the reduction, the instance's
    ``name`` says which of them it is."""

    name: ClassVar[str] = "fsdp2"

    def __init__(self, env: SourceEnv) -> None:
        super().__init__(env)
        self.name = detect_sharded(env.model) or "fsdp2"  # type: ignore[misc]
        self.local_is_partial = self.name.endswith("+tp")
        """The pre-reduction gradients are themselves TP shards: their norm is partial."""
        self._norms: ShardedNorms | None = None
        self._units: list[FSDPUnit] = []
        self._restore: list[tuple[torch.nn.Module, Any]] = []
        self._restore_gather: list[tuple[torch.nn.Module, Any]] = []
        self._restore_hook: list[tuple[torch.nn.Module, Any]] = []
        self._all_probed = False
        self._reduced_since_end = 0
        self._pieces: list[_LocalPiece] = []
        self._local_exact = True
        self._scaled = False
        self._sampler = LocalNormSampler(env.local_norm_every)
        self._skipped_units = 0
        """Units whose norm pass this step was replaced by the (finite) sum check."""
        self._data_checked = False
        self._fingerprint: data_check.Fingerprint | None = None
        self._replicate_group: Any = None
        """HSDP: the replicate dim's group, the duplicate-data check's second group."""
        self._ordered: list[tuple[Any, int]] = []
        """(FSDPParam, position) of every unit, until the first forward hooks them."""
        self._order_hook: Any = None

    def data_check_scope(self) -> tuple[str | None, str]:
        if self.name.startswith("hsdp"):
            return "the shard group and the replicate group of each rank", ""
        if self.name.endswith("+tp"):
            return "the dp dim (each rank's reduce-scatter group; TP peers share a batch)", ""
        return "the FSDP2 reduce-scatter group", ""

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        """HSDP: the ranks of a replicate group hold the same local shards (same shard and TP
        coordinates); FSDP2+TP: the TP ranks of one data-parallel coordinate hold the same
        shards of what TP replicates; FSDP2 alone shards every parameter over all its ranks."""
        if self.name == "fsdp2+tp":  # the TP-replicated shards (norms, row-wise biases)
            return tp_replica_scope(self.index)
        if not self.name.startswith("hsdp"):
            return None, "FSDP2 shards every parameter: no two ranks hold the same shard"
        if self._replicate_group is None:
            return None, "the replicate dim's process group was not found"
        params = self.index.params
        scope = ReplicaScope(lambda: [dtensor_local(p) if hasattr(p, "to_local") else p
                                      for p in params],
                             self.index.all_positions, self._replicate_group,
                             "the replicate group of each rank (HSDP)")
        return scope, ""

    def batch_share(self) -> BatchShare:
        """Each data-parallel rank reads its own batch; under +tp the TP ranks (the mesh dims
        after FSDP2's one, HSDP's two) share theirs."""
        if not self.name.endswith("+tp"):
            return BatchShare()
        dims = 2 if self.name.startswith("hsdp") else 1
        return BatchShare(ranks=split_degree(self.index.params, dims), over="the TP ranks")

    # ---------------------------------------------------------------- install / close
    def install(self) -> None:
        self._norms = ShardedNorms(self.index, self.env.span)
        self._clip.norms = self._norms
        probed = 0
        modules = fsdp_modules(self.env.model)
        for module in modules:
            try:
                if self._probe_module(module):
                    probed += 1
            except Exception as exc:  # older/newer torch internals: reduced norms still work
                log.warning(
                    "ddpmon: no pre-reduce-scatter gradients for %s (%s); local numbers "
                    "for it are not measured",
                    type(module).__name__,
                    exc,
                )
        with_params = sum(1 for m in modules if self._has_params(m))
        self._all_probed = probed == with_params and probed > 0
        for unit in self._units:  # until the unsharded parameters are hooked (below)
            self.index.order.together(unit.positions)
        self._norms.local_pass = ShardPass([(u.positions, u.columns) for u in self._units],
                                           len(self.index))
        self._order_hook = self.env.model.register_forward_hook(self._order_by_compute)
        self._handles.append(self._order_hook)

    def _order_by_compute(self, *_: Any) -> None:
        """End of the first forward: every unit's unsharded parameter exists; hook them, so the
        origin's backward order is the order autograd computes the gradients in
        (``probes.backward_order``). One shot; never raises into the forward."""
        try:
            self._order_hook.remove()
            ordered, self._ordered = self._ordered, []
            unsharded = [(fsdp_unsharded_param(fp), pos) for fp, pos in ordered]
            if not unsharded or any(t is None for t, _ in unsharded):
                return  # by unit then: each unit's parameters ready at once (``together``)
            for tensor, pos in unsharded:
                self.index.order.watch_one(tensor, pos)
            self.index.order.apart()  # measured per parameter: no block to reorder
        except Exception as exc:
            self.env.on_error("grads", exc)

    @staticmethod
    def _has_params(module: torch.nn.Module) -> bool:
        try:
            return any(g.fsdp_params for g in _param_groups(module))
        except Exception:
            return True

    def _probe_module(self, module: torch.nn.Module) -> bool:
        groups = _param_groups(module)
        if not groups or not any(g.fsdp_params for g in groups):
            return False
        if len(groups) != 1:
            raise ValueError("several parameter groups (shard_placement_fn with several meshes)")
        group = groups[0]
        positions, columns = [], []
        for fsdp_param in group.fsdp_params:
            pos = self.index.position.get(id(fsdp_param.sharded_param))
            if pos is None:  # frozen: FSDP2 reduces no gradient for it
                continue
            positions.append(pos)
            columns.append(_columns(fsdp_param))
            self._ordered.append((fsdp_param, pos))
        reduce_scatter, _, _, hsdp = fsdp_group_comms(group)
        inner = reduce_scatter or DefaultReduceScatter()
        unit = FSDPUnit(positions=positions, columns=columns, hsdp=hsdp)
        unit.group = fsdp_reduce_scatter_group(group)
        unit.alone = unit.group is not None and unit.group.size() == 1
        if unit.hsdp and self._replicate_group is None:
            self._replicate_group = getattr(group.mesh_info, "replicate_process_group", None)
        module.set_custom_reduce_scatter(ProbedReduceScatter(inner, unit, self))
        self._restore.append((module, inner))
        self._units.append(unit)
        self._time_gathers(module, group, unit)
        return True

    def _time_gathers(self, module: torch.nn.Module, group: Any, unit: FSDPUnit) -> None:
        """All-gathers (``set_custom_all_gather``) and, under HSDP, the replicate-dim
        all-reduce (``set_all_reduce_hook``, the user's own hook kept). Public FSDP2 APIs,
        undone at close; a failure costs only these timings."""
        try:
            gather = fsdp_group_comms(group)[1] or DefaultAllGather()
            module.set_custom_all_gather(TimedAllGather(gather, self))
            self._restore_gather.append((module, gather))
        except Exception as exc:
            self.env.on_error("comm", exc)
        if unit.hsdp:
            try:
                user_hook = fsdp_group_comms(group)[2]
                module.set_all_reduce_hook(AllReduceTimer(unit, self, user_hook))
                self._restore_hook.append((module, user_hook))
            except Exception as exc:
                self.env.on_error("comm", exc)

    def close(self) -> None:
        for module, inner in self._restore:
            try:
                module.set_custom_reduce_scatter(inner)
            except Exception:
                pass
        self._restore.clear()
        for module, gather in self._restore_gather:
            try:
                module.set_custom_all_gather(gather)
            except Exception:
                pass
        self._restore_gather.clear()
        for module, hook in self._restore_hook:
            try:
                for group in _param_groups(module):  # set_all_reduce_hook refuses None
                    set_all_reduce_hook(group, hook)
            except Exception:
                pass
        self._restore_hook.clear()
        if self._norms is not None:
            try:
                self._norms.wait()
            except Exception:
                pass
        super().close()

    # ---------------------------------------------------------------- measurement
    def observe_reduce_input(
        self, unit: FSDPUnit, flat: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Per-parameter norms of this rank's pre-reduction gradients (the reduce-scatter input,
        ``world`` rows of concatenated padded per-rank chunks). Never raises."""
        self._reduced_since_end += 1
        if len(self._pieces) > _MAX_PIECES_PER_UNIT * max(1, len(self._units)):
            self._pieces.clear()  # collect() is not being called: stay bounded
            self._local_exact = False
        check = self._data_check_now(group)
        norms = None
        try:
            unit.reductions += 1
            with torch.no_grad():
                if not check and not self._local_pass_now(flat):
                    self._skipped_units += 1
                    return
                world = group.size()
                if flat.dtype not in _UNSCALED_REDUCE_DTYPES:
                    self._local_exact = False  # pre-divided: the flag holds, the norm does not
                if unit.positions and flat.numel() == world * unit.row_numel:
                    norms = unit_norms(unit, flat, world)
                    self._pieces.append(_LocalPiece(norms, list(unit.positions)))
                else:
                    # Some parameter of the unit had no gradient: the layout is ambiguous, so
                    # the unit is judged as a whole and named by its first parameter.
                    self._local_exact = False
                    first = unit.positions[:1] or [0]
                    norms = per_param_norms([flat])
                    self._pieces.append(_LocalPiece(norms, first))
        except Exception as exc:
            self._local_exact = False
            self.env.on_error("grads", exc)
        finally:
            if check:  # every rank of the group gathers, even after a failure here
                self._launch_data_check(flat, norms, group)

    def _data_check_now(self, group: dist.ProcessGroup) -> bool:
        """The duplicate-data check runs on this step's first reduce-scatter (the same unit on
        every rank: FSDP2 reduces in one order everywhere)."""
        due = data_check.due(self.env.data_check_interval, self._sampler.steps)
        if self._data_checked or not due:
            return False
        self._data_checked = True
        try:
            return group.size() > 1
        except Exception:
            return False

    def _launch_data_check(self, flat: torch.Tensor, norms: torch.Tensor | None,
                           group: dist.ProcessGroup) -> None:
        try:
            if norms is None:  # the pass failed: a value that matches nothing
                norms = torch.full((1,), float("nan"), device=flat.device)
            groups = [group] if self._replicate_group is None else [group, self._replicate_group]
            self._fingerprint = data_check.launch(norms, groups)
        except Exception as exc:
            self.env.on_error("data", exc)

    def _local_pass_now(self, flat: torch.Tensor) -> bool:
        """Measure this unit's local norms? Always on accelerators (the pass costs microseconds
        there, and the check below would read a device value) and on every
        ``local_norm_every``-th step on CPU; on other CPU steps only when the buffer's sum is
        non-finite (read on the host: a CPU tensor, no sync)."""
        if self._sampler.due(flat.device):
            return True
        return not math.isfinite(float(flat.sum()))

    def on_backward_end(self) -> None:
        for unit in self._units:  # a one-rank unit's input never followed by its output
            unit.pending_input = None
        reduced = self._reduced_since_end > 0 or not self._all_probed
        self._reduced_since_end = 0
        if not reduced or self._norms is None:  # a no-sync micro-step: shards unchanged
            return
        self._scaled = self.env.grads_scaled_now()
        try:
            with torch.no_grad():
                self._norms.measure(self._scaled)
        except Exception as exc:
            self.env.on_error("grads", exc)

    def collect(self) -> GradSummaries:
        out = GradSummaries()
        try:
            out.local, out.local_complete = self._local_vector()
        except Exception as exc:
            self.env.on_error("grads", exc)
        fingerprint, self._fingerprint, self._data_checked = self._fingerprint, None, False
        out.identical_ranks = data_check.identical_ranks(fingerprint, self.env.on_error)
        if self._norms is not None:
            try:
                self._take_reduced(self._norms, out)
            except Exception as exc:
                self.env.on_error("grads", exc)
        return out

    def inflight(self) -> GradSummaries | None:
        """Exit path: the local norms of the reduce-scatter inputs seen so far this step (left
        in place; the reduced norms would need a collective, which a failed step may never
        complete)."""
        pieces = list(self._pieces)
        if not pieces:
            return None
        device = pieces[0].norms.device
        norms = torch.cat([p.norms.to(device) for p in pieces])
        return GradSummaries(local=NormVector(norms, [i for p in pieces for i in p.positions],
                                              self._scaled), local_complete=False)

    def _local_vector(self) -> tuple[NormVector | None, bool]:
        pieces, self._pieces = self._pieces, []
        exact, self._local_exact = self._local_exact, True
        skipped, self._skipped_units = self._skipped_units, 0
        self._sampler.step_done()
        twice = any(u.reductions > 1 for u in self._units)
        for unit in self._units:
            unit.reductions = 0
        if not pieces:
            return None, True
        device = pieces[0].norms.device
        norms = torch.cat([_on(p.norms, device) for p in pieces])
        positions = [pos for p in pieces for pos in p.positions]
        complete = (
            exact and self._all_probed and not twice and not self.local_is_partial and not skipped
        )
        return NormVector(norms, positions, self._scaled), complete


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    _record_current_stream(tensor)
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _record_current_stream(tensor: torch.Tensor) -> None:
    """A tensor made on FSDP2's reduce-scatter stream is read on the current stream: keep the
    allocator from reusing it early (CUDA only; ordering comes from FSDP2's own event waits)."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


__all__ = ["FSDPSource", "detect_sharded", "fsdp_modules"]
