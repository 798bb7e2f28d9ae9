"""Gradient source for tensor parallel (``parallelize_module``; DTensor gradients, no FSDP2).

TP has no data-parallel reduction of gradients: each rank's gradient pieces are final when the
backward ends. So one fused norm pass over the local pieces at ``on_backward_end`` serves both
numbers:

- ``local``: the raw pieces this rank holds (its non-finite flag and first position name the
  origin parameter; its norm is of shards, so ``local_complete`` is False);
- ``reduced``: the same per-parameter squares, SUMmed over the TP dim for ``Shard`` placements,
  counted once for ``Replicate`` and plain parameters, ``Partial`` reduced first
  (``dtensor_norms``), with one small all-reduce at ``collect``.

Nothing tells a TP model's backward apart from a gradient-accumulation micro-step, so every
backward is measured (the last one, taken before the user's clip, is reported): with k
micro-steps that is k passes over 1/tp of the gradients.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import BatchShare, GradSummaries, NormVector, SourceEnv
from .dtensor_norms import ShardedNorms
from .model_parallel import split_degree
from .replicas import ReplicaScope, tp_replica_scope
from .sharded_source import ShardedSource


class TensorParallelSource(ShardedSource):
    name: ClassVar[str] = "tp"

    def data_check_scope(self) -> tuple[str | None, str]:
        return None, "tensor parallel alone: no data-parallel ranks to compare"

    def __init__(self, env: SourceEnv) -> None:
        super().__init__(env)
        self._norms: ShardedNorms | None = None
        self._local: NormVector | None = None

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        return tp_replica_scope(self.index)

    def batch_share(self) -> BatchShare:
        """The TP ranks shard the model, not the data: they train on the same batch."""
        return BatchShare(ranks=split_degree(self.index.params), over="the TP ranks")

    def install(self) -> None:
        self._norms = ShardedNorms(self.index, self.env.span)
        self._clip.norms = self._norms

    def on_backward_end(self) -> None:
        if self._norms is None:
            return
        self._local = None
        try:
            scaled = self.env.grads_scaled_now()
            with torch.no_grad():
                positions, norms = self._norms.measure(scaled)
            if norms is not None:
                self._local = NormVector(norms, positions, scaled)
        except Exception as exc:
            self.env.on_error("grads", exc)

    def collect(self) -> GradSummaries:
        local, self._local = self._local, None
        out = GradSummaries(local=local, local_complete=False)
        if self._norms is not None:
            try:
                self._take_reduced(self._norms, out)
            except Exception as exc:
                self.env.on_error("grads", exc)
        return out

    def close(self) -> None:
        if self._norms is not None:
            try:
                self._norms.wait()
            except Exception:
                pass
        super().close()


__all__ = ["TensorParallelSource"]
