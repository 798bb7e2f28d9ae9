"""DDP: the communication hook sees each bucket of *local* gradients before the all-reduce
(local norms, the origin of a NaN, all-reduce timing and bytes) and the reduced bucket after it
(the global norms, taken before any clipping the loop does after backward).

The hook wraps the user's own hook (default: ``allreduce_hook``) so compression hooks such as
PowerSGD or fp16 keep working: it reads the local bucket *before* handing it to the inner hook,
and the reduced bucket in a ``then`` callback *after* the inner hook's future completes. It never
reads a device value on the host; timings are wall clock on CPU and CUDA events on GPU (resolved
lazily at readback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..probes.comm import CollectiveRecorder, tensor_bytes
from ..probes.grads import ParamIndex, full_pass, per_param_norms
from . import data_check
from .base import GradientSource, GradSummaries, NormVector, SourceEnv
from .local_sampling import LocalNormSampler
from .replicas import ReplicaScope

log = logging.getLogger("ddpmon.comm")


@dataclass(slots=True)
class BucketParts:
    """What the hook saw during one step, collected across buckets (and autograd threads)."""

    local_norms: list[torch.Tensor] = field(default_factory=list)
    local_positions: list[int] = field(default_factory=list)
    reduced_norms: list[torch.Tensor] = field(default_factory=list)
    reduced_positions: list[int] = field(default_factory=list)
    buckets: int = 0
    reduced_complete: bool = True
    local_buckets: int = 0
    """Buckets whose local norms were measured before the all-reduce (all of them on sampled
    steps and on CUDA); the local norm is reported only when this equals ``buckets``."""
    fingerprint: data_check.Fingerprint | None = None
    """The duplicate-data check's gather, on sampled steps (:mod:`.data_check`)."""


class CommProbe:
    """Callable DDP comm hook: ``model.register_comm_hook(None, probe.hook)``."""

    def __init__(
        self,
        index: ParamIndex,
        *,
        inner_hook: Callable | None = None,
        inner_state: Any = None,
        on_error: Callable[[str, BaseException], None],
        data_check_interval: int = 10,
        local_norm_every: int = 1,
        grads_are_bucket_views: bool = False,
        collectives: CollectiveRecorder | None = None,
        group: Any = None,
    ) -> None:
        """``group``: the DDP module's process group (``None``: the default one), over which
        the gradients are all-reduced without a user hook (as DDP's own reduction does) and
        the duplicate-data check gathers."""
        if inner_hook is None:
            # allreduce_hook with no state reduces over the default (WORLD) group: a DDP on a
            # subgroup (DDP beside PP or TP, a group with its own timeout) must keep its own
            inner_hook = allreduce_hook
            inner_state = group
        self.index = index
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self._on_error = on_error
        self._parts = BucketParts()
        self._data_check_interval = data_check_interval
        self._group = group
        self._sampler = LocalNormSampler(local_norm_every)
        self._grads_are_bucket_views = grads_are_bucket_views
        self.collectives = collectives or CollectiveRecorder(on_error)
        """Each bucket's all-reduce is recorded here as one ``all_reduce``."""

    def current(self) -> BucketParts:
        """What has been collected so far for the step in progress (read-only use)."""
        return self._parts

    def take(self) -> BucketParts:
        """Hand over what was collected for the step that just finished, start a new one."""
        parts, self._parts = self._parts, BucketParts()
        self._sampler.step_done()
        return parts

    def _local_pass_now(self, bucket: Any, check_data: bool) -> bool:
        """Measure local norms before the all-reduce on this bucket?

        Always on accelerators (a pass costs microseconds, and origin detection there must
        not branch on a device value) and when ``param.grad`` *is* the bucket (the all-reduce
        then overwrites the local values). On CPU, where a pass over the gradients costs
        milliseconds, only every ``local_norm_every`` steps: on other steps the single pass is
        the reduced one, and a rank's local gradients are examined only if the reduced ones
        are non-finite (a NaN/Inf anywhere reaches the sum), from ``param.grad``, which DDP
        leaves local until the step's buckets are finalised. Exact either way."""
        if check_data or self._grads_are_bucket_views:
            return True
        return self._sampler.due(bucket.buffer().device)

    def _data_check_due(self, bucket: Any) -> bool:
        due = data_check.due(self._data_check_interval, self._sampler.steps)
        if bucket.index() != 0 or not due:
            return False

        return dist.is_initialized() and dist.get_world_size(self._group) > 1

    def hook(self, state, bucket):  # unannotated: DDP validates real annotations, not strings
        parts = self._parts
        positions: list[int] | None = None
        params: list = []
        local_done = True
        try:
            params = bucket.parameters()
            positions = [self.index.position[id(p)] for p in params]
            check_data = self._data_check_due(bucket)
            local_done = self._local_pass_now(bucket, check_data)
            if local_done:
                local_norms = per_param_norms(bucket.gradients())
                parts.local_norms.append(local_norms)
                parts.local_positions.extend(positions)
                parts.local_buckets += 1
                if check_data:  # before the bucket's all-reduce, on every rank alike
                    parts.fingerprint = data_check.launch(local_norms, [self._group])
            parts.buckets += 1
        except Exception as exc:  # never let a probe break the all-reduce
            positions = None
            self._on_error("comm", exc)
        buffer, start = None, None
        try:
            buffer = bucket.buffer()
            start = self.collectives.start(buffer)
        except Exception as exc:
            self._on_error("comm", exc)
        began = self.collectives.issue.begin()
        fut = self.inner_hook(self.inner_state, bucket)
        self.collectives.issue.end(began)  # the bucket's issue: its own path to the network
        shapes = [p.numel() for p in bucket.parameters()] if positions is not None else None

        def done(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()  # re-raises a failed all-reduce: that error is the user's
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            try:
                if start is not None:
                    self.collectives.stop("all_reduce", start, tensor_bytes(buffer))
                if positions is not None and shapes is not None and tensor.numel() == sum(shapes):
                    views, offset = [], 0
                    for n in shapes:
                        views.append(tensor.narrow(0, offset, n))
                        offset += n
                    reduced = per_param_norms(views)
                    parts.reduced_norms.append(reduced)
                    parts.reduced_positions.extend(positions)
                    # not local_done: only where a host read is free (LocalNormSampler.due)
                    if not local_done and not torch.isfinite(reduced).all():
                        self._local_rare_path(parts, params, positions)
                else:
                    parts.reduced_complete = False
            except Exception as exc:
                parts.reduced_complete = False
                self._on_error("comm", exc)
            return tensor

        return fut.then(done)

    @staticmethod
    def _local_rare_path(parts: BucketParts, params: list, positions: list[int]) -> None:
        """The reduced bucket is non-finite: were *this rank's* gradients the cause? DDP has
        not copied the reduced values into ``param.grad`` yet, so these are the local ones."""
        pairs = [(p.grad, i) for p, i in zip(params, positions, strict=True) if p.grad is not None]
        if pairs:
            parts.local_norms.append(per_param_norms([g.detach() for g, _ in pairs]))
            parts.local_positions.extend(i for _, i in pairs)


class DDPSource(GradientSource):
    """``DistributedDataParallel``: norms from the comm hook (which wraps the user's own hook)."""

    name = "ddp"

    def __init__(self, env: SourceEnv) -> None:
        super().__init__(env)
        self.probe: CommProbe | None = None

    def install(self) -> None:
        env, model = self.env, self.env.model
        probe = CommProbe(
            self.index,
            inner_hook=env.comm_hook,
            inner_state=env.comm_state,
            on_error=env.on_error,
            data_check_interval=env.data_check_interval,
            local_norm_every=env.local_norm_every,
            grads_are_bucket_views=bool(getattr(model, "gradient_as_bucket_view", False)),
            collectives=self.collectives,
            group=getattr(model, "process_group", None),
        )
        try:
            model.register_comm_hook(None, probe.hook)
            self.probe = probe
        except Exception as exc:
            log.warning(
                "ddpmon: could not register its DDP comm hook (%s). If you use your own "
                "comm hook, pass it as ddpmon.attach(..., comm_hook=hook, comm_state=state) "
                "instead of registering it. Local pre-all-reduce norms and all-reduce "
                "timings are off; reduced norms still work.",
                exc,
            )
            env.on_error("comm", exc)

    def data_check_scope(self) -> tuple[str | None, str]:
        return "the ranks of the DDP process group", ""

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        """DDP broadcasts the parameters at wrap time and all-reduces every gradient, so every
        rank of its process group holds the same parameters after each step."""
        group = getattr(self.env.model, "process_group", None)
        params = self.index.params
        scope = ReplicaScope(lambda: params, self.index.all_positions, group,
                             "the ranks of the DDP process group")
        return scope, ""

    def collect(self) -> GradSummaries:
        parts = self.probe.take() if self.probe is not None else None
        if parts is None or not parts.buckets:
            # No bucket this step (the hook is off): the final .grad tensors, as they are now.
            return GradSummaries(reduced=full_pass(self.index, scaled=self.env.grads_scaled_now()))
        out = GradSummaries(
            local_complete=parts.local_buckets == parts.buckets,
        )
        if parts.reduced_complete and parts.reduced_norms:
            out.reduced = NormVector(torch.cat(parts.reduced_norms), parts.reduced_positions)
        else:
            out.reduced = full_pass(self.index, scaled=self.env.grads_scaled_now())
        if parts.local_norms:
            out.local = NormVector(torch.cat(parts.local_norms), parts.local_positions)
        out.identical_ranks = data_check.identical_ranks(parts.fingerprint, self.env.on_error)
        return out

    def inflight(self) -> GradSummaries | None:
        """Exit path: the buckets the hook has seen of the step in progress, left in place (the
        step never reached ``collect``). None when it has seen none."""
        parts = self.probe.current() if self.probe is not None else None
        if parts is None or not parts.buckets:
            return None
        out = GradSummaries(local_complete=False)
        if parts.reduced_norms:
            out.reduced = NormVector(torch.cat(parts.reduced_norms), parts.reduced_positions)
        if parts.local_norms:
            out.local = NormVector(torch.cat(parts.local_norms), parts.local_positions)
        return out

    def clip_norm(self, params) -> torch.Tensor:
        """Reuse the reduced per-bucket norms the hook measured (no pass over the gradients)
        when it saw exactly ``params`` this step; else one pass."""
        reused = self._reduced_norm_for(params)
        return reused if reused is not None else super().clip_norm(params)

    def _reduced_norm_for(self, params) -> torch.Tensor | None:
        parts = self.probe.current() if self.probe is not None else None
        if parts is None or not parts.reduced_complete or not parts.reduced_norms:
            return None
        wanted = {self.index.position.get(id(p), -1) for p in params}
        if wanted != set(parts.reduced_positions):
            return None
        norms = torch.cat(parts.reduced_norms)
        total = (norms * norms).sum().sqrt()
        scale = self.env.current_scale()
        if scale is not None and not self.env.grads_scaled_now():
            total = total / scale.to(total.dtype)  # bucket norms were of scaled gradients
        return total
