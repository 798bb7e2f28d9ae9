"""DeepSpeed ZeRO 0-3: the engine's optimizer steps, global norm and local (pre-reduction) norms.

``ddpmon.attach(engine)`` with a ``DeepSpeedEngine``. Everything here reads the engine's own
objects; DeepSpeed's private names used (version-fragile, each failure is counted by the guard)
are ``_hp_mapping``/``_index_in_param_group`` (ZeRO-1/2), ``fp16_groups``/``averaged_gradients``
(ZeRO-3) and ``loss_scaler``/``cur_scale`` (fp16). See ``docs/parallelism.md`` (DeepSpeed ZeRO).

- **Step** (``EngineSteps``, :mod:`.steps`): ``engine.step`` is wrapped on the
  instance; a call that moves ``engine.global_steps`` is one optimizer step, skipped when
  ``engine.skipped_steps`` moved too. Host counters only: no device read.
- **Global norm** (``DeepSpeedSource.measure_reduced``): at the entry of the ``engine.step`` that
  closes an accumulation boundary (gradients reduced, not yet clipped or unscaled). One fused norm
  pass over this rank's reduced partitions (ZeRO-1/2: each parameter's slice; ZeRO-3: the grad
  partitions, whose padding is zero), one SUM all-reduce of one float64 per parameter over the
  data-parallel group (issued async, waited when the step closes, after DeepSpeed's own step
  collectives), divided by the loss scale (a host float). Stage 0: the replicated
  ``param.grad`` after DeepSpeed's all-reduce, no collective.
- **Local norm and NaN origin**: a tensor hook per parameter sees each micro-batch's gradient
  before DeepSpeed's post-accumulate hooks copy it into a reduction bucket (ZeRO-2/3 reduce every
  micro-batch). The hook reduces it at once to one device float64 (its squared norm; on CPU
  accumulated in float32, an overflow re-measured in float64), because DeepSpeed re-points the
  gradient's storage at its bucket right after. Micro-batches fold by adding squares: the step's
  local norm of a parameter is sqrt(sum over micro-batches of ||g_mb||^2); a parameter is
  non-finite when any micro-batch's gradient was.
- **Collectives** (``CommTimer``): the ``deepspeed.comm`` functions ZeRO calls (``dist.<op>`` is
  looked up at call time) are wrapped while a source is attached and restored at close:
  ``all_reduce``, ``reduce``, ``reduce_scatter_fn`` / ``reduce_scatter_tensor`` /
  ``reduce_scatter``, ``all_gather_into_tensor`` / ``allgather_fn`` / ``all_gather``,
  ``broadcast``. Each call
  is timed through the source's ``CollectiveRecorder`` (wall time on CPU, events on GPU, async
  handles at completion); DeepSpeed's ``comms_logger`` is never used (it synchronises after
  every op).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...host_reads import host_read_free
from ...probes.grads import per_param_norms
from .. import data_check
from ..base import GradientSource, GradSummaries, NormVector, StepHost, UpdateSettings
from ..reduction import FlaggedSum, Issued
from ..replicas import ReplicaScope
from .comm import CommTimer
from .markers import engine_markers
from .steps import attached_engines
from .updates import engine_update_probe

log = logging.getLogger("ddpmon")

__all__ = [
    "DeepSpeedSource",
    "EngineFacts",
    "BARE_MODULE_WARNING",
    "CommTimer",
    "attach_error",
    "engine_facts",
    "is_engine",
]

def is_engine(obj: Any) -> bool:
    """A ``deepspeed.runtime.engine.DeepSpeedEngine`` (or subclass), told without importing it."""
    return any(
        c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
        for c in type(obj).__mro__
    )


def _call(engine: Any, name: str, default: Any = None) -> Any:
    method = getattr(engine, name, None)
    if not callable(method):
        return default
    try:
        return method()
    except Exception:
        return default


@dataclass(slots=True)
class EngineFacts:
    """What ddpmon read from the engine at attach (also written to the manifest)."""

    stage: int | None
    precision: str
    """fp32 | fp16 | bf16."""
    gradient_accumulation_steps: int | None
    gradient_clipping: float | None
    optimizer: str
    """Type name of ``engine.optimizer`` (DeepSpeed's wrapper or the torch optimizer)."""
    unreadable: list[str] = field(default_factory=list)
    """Features ddpmon cannot measure through (one warning each)."""

    def manifest(self) -> dict:
        return asdict(self)


def engine_facts(engine: Any) -> EngineFacts:
    stage = _call(engine, "zero_optimization_stage")
    if _call(engine, "fp16_enabled", False):
        precision = "fp16"
    elif _call(engine, "bfloat16_enabled", False):
        precision = "bf16"
    else:
        precision = "fp32"
    unreadable = []
    if _call(engine, "is_deepcompile_enabled", False):
        unreadable.append("DeepCompile")
    if _call(engine, "zero_quantized_gradients", False):
        unreadable.append("ZeRO++ quantized gradients")
    opt_name = type(getattr(engine, "optimizer", None)).__name__
    if stage not in (0, 1, 2, 3) or opt_name not in _KNOWN_OPTIMIZERS.get(stage, (opt_name,)):
        unreadable.append(f"optimizer {opt_name} at ZeRO stage {stage}")
    return EngineFacts(
        stage=stage if isinstance(stage, int) else None,
        precision=precision,
        gradient_accumulation_steps=_call(engine, "gradient_accumulation_steps"),
        gradient_clipping=_call(engine, "gradient_clipping"),
        optimizer=opt_name,
        unreadable=unreadable,
    )


_KNOWN_OPTIMIZERS: dict[Any, tuple[str, ...]] = {
    1: ("DeepSpeedZeroOptimizer",),
    2: ("DeepSpeedZeroOptimizer",),
    3: ("DeepSpeedZeroOptimizer_Stage3",),
}
"""Stage 0 accepts any optimizer (``param.grad`` is read); other stages need these wrappers."""

_WARNINGS = {
    "DeepCompile": "ddpmon: DeepSpeed DeepCompile is enabled; ddpmon cannot read its gradients "
    "(reduced inside compiled ops): no gradient norms or NaN origin; steps, skipped steps and "
    "the loss scale are still measured.",
    "ZeRO++ quantized gradients": "ddpmon: DeepSpeed ZeRO++ quantized gradients "
    "(zero_quantized_gradients) are enabled; ddpmon cannot read their reduction: no global or "
    "group gradient norms; local norms, NaN origin, steps and the loss scale are still measured.",
}


def _warning(feature: str) -> str:
    return _WARNINGS.get(
        feature,
        f"ddpmon: cannot read DeepSpeed's {feature}: no global or group gradient norms; local "
        "norms, NaN origin, steps and the loss scale are still measured.",
    )


def attach_error(model: Any, optimizer: Any) -> str | None:
    """Why ``attach(model, optimizer)`` must not start for DeepSpeed, or None."""
    if is_engine(model):
        if model in attached_engines:
            return (
                "ddpmon is already attached to this DeepSpeedEngine; close the first monitor "
                "before attaching again"
            )
        return None
    if type(optimizer).__module__.startswith("deepspeed") or any(
        hasattr(p, "ds_id") for p in model.parameters()
    ):
        return (
            "the model is managed by DeepSpeed but is not the DeepSpeedEngine: call "
            "ddpmon.attach(engine) with the engine that deepspeed.initialize returns"
        )
    return None


BARE_MODULE_WARNING = (
    "ddpmon: DeepSpeed is imported and this model is a bare module with a torch optimizer; if "
    "deepspeed.initialize will wrap it, attach to the engine it returns instead "
    "(ddpmon.attach(engine)): attached before, ddpmon measures it as a plain model."
)


class DeepSpeedSource(GradientSource):
    """Gradient source for a ``DeepSpeedEngine`` (``env.model``); see the module doc."""

    name = "deepspeed"
    decides_steps = True

    def __init__(self, env) -> None:
        super().__init__(env)
        self.engine = env.model
        self.facts = self.engine_facts = engine_facts(self.engine)
        self.name = f"deepspeed-zero{self.facts.stage}"  # type: ignore[misc]
        self._sq: list[torch.Tensor | None] = [None] * len(self.index)
        self._sum = FlaggedSum(self._reduce)
        """This step's squared norms, their all-reduce in flight and (its context) the scale to
        divide by."""
        self._positions: dict[tuple, torch.Tensor] = {}
        self._scale_used: float | torch.Tensor = 1.0
        """The loss scale this step's gradients carry, noted before ``engine.step`` updates it."""
        self._local_on = "DeepCompile" not in self.facts.unreadable
        self._steps = 0
        self._fingerprint: data_check.Fingerprint | None = None
        self._reduced_on = not self.facts.unreadable
        self._comm: CommTimer | None = None
        self._ready: NormVector | None = None
        """The step's reduced norms, finished early for a rerun decision (``reduced_now``)."""

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        """ZeRO-0/1/2 keep the whole module on every data-parallel rank (ZeRO-1/2 gather the
        updated partitions into it after each step); ZeRO-3 partitions it."""
        if self.facts.stage not in (0, 1, 2):
            return None, "ZeRO-3 partitions the parameters: no two ranks hold the same ones"
        group = getattr(self.engine.optimizer, "dp_process_group", None)
        if group is None:
            group = getattr(self.engine, "data_parallel_group", None)
        params = self.index.params
        # ZeRO-1/2 rewrite the module's parameters in the step (the all-gather from the
        # owners' partitions): compared as the next forward finds them
        scope = ReplicaScope(lambda: params, self.index.all_positions, group,
                             "the engine's data-parallel group",
                             at_forward=self.facts.stage in (1, 2))
        return scope, ""

    def data_check_scope(self) -> tuple[str | None, str]:
        if not self._local_on:
            return None, "DeepSpeed's gradients are not readable here (no local norms)"
        return "the engine's data-parallel group", ""

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        for feature in self.facts.unreadable:
            log.warning(_warning(feature))
        try:
            self._comm = CommTimer(self.collectives)
        except Exception as exc:  # no deepspeed.comm to wrap: no timings, the rest works
            self.env.on_error("comm", exc)
        if not self._local_on:
            return
        for pos, param in enumerate(self.index.params):
            self._handles.append(param.register_hook(self._local_hook(pos)))

    def _local_hook(self, pos: int) -> Callable[[torch.Tensor], None]:
        sq = self._sq
        on_error = self.env.on_error

        def hook(grad: torch.Tensor) -> None:
            try:
                norm = _local_norm(grad.detach())
                prev = sq[pos]
                sq[pos] = norm * norm if prev is None else prev + norm * norm
            except Exception as exc:  # never into backward
                on_error("grads", exc)

        return hook

    # ------------------------------------------------------------------ boundary
    def loss_scale(self) -> float | torch.Tensor:
        """The scale the current gradients carry (1.0 without fp16); a host float as
        DeepSpeed keeps it (``cur_scale``), never read from a device."""
        if self.facts.precision != "fp16":
            return 1.0
        opt = self.engine.optimizer
        for name in ("loss_scale", "cur_scale"):
            value = getattr(opt, name, None)
            if isinstance(value, (int, float, torch.Tensor)):
                return value
        cfg = getattr(opt, "loss_scale_config", None)
        value = getattr(cfg, "cur_scale", None)
        return value if isinstance(value, (int, float, torch.Tensor)) else 1.0

    def note_scale(self) -> None:
        """At the entry of ``engine.step``: the scale in use, before the scaler updates it."""
        self._scale_used = self.loss_scale()

    def measure_reduced(self) -> None:
        """At the entry of a boundary ``engine.step``: the reduced, pre-clip gradients.

        ZeRO 1-3 hold disjoint pieces: their per-parameter squares are summed over the data-
        parallel group by the strategies' one protocol (:mod:`.reduction`: a failed rank still
        takes part, every rank then reports norms of 0 for that step, never NaN). ZeRO-0's
        gradients are whole: nothing is communicated, and a failure is raised at once. The
        failure is counted on the rank it happened.
        """
        self._sum.pending = None
        self._launch_data_check()
        if not self._reduced_on:
            return
        n = len(self.index)
        collective = self.facts.stage in (1, 2, 3)

        def values() -> torch.Tensor:
            tensors, positions = self._reduced_pieces()
            sq = torch.zeros(n, dtype=torch.float64, device=_device(tensors, self.index))
            if tensors:
                norms = per_param_norms(tensors).to(sq.device, torch.float64)
                sq.index_copy_(0, self._position_tensor(positions, sq.device), norms * norms)
            return sq

        if not collective:  # ZeRO-0: whole gradients, no sum to take part in
            vector = values()
            self._sum.pending = Issued(torch.cat([vector, vector.new_zeros(1)]), None,
                                       self._scale_used)
            return
        failure = self._sum.issue(values, n, _device([], self.index), self._scale_used)
        if failure is not None:
            raise failure

    def _reduce(self, vector: torch.Tensor) -> Any:
        """The SUM over the data-parallel group, waited on at ``collect()``: by then DeepSpeed's
        own step collectives are done."""
        group = getattr(self.engine.optimizer, "dp_process_group", None)
        return torch.distributed.all_reduce(vector, group=group, async_op=True)

    def _launch_data_check(self) -> None:
        """The duplicate-data check (:mod:`.data_check`) at the boundary ``engine.step``, on
        every rank alike: the fingerprint is this step's local squared norms, which the tensor
        hooks summed over its micro-batches before DeepSpeed reduced anything."""
        self._fingerprint = None
        if not self._local_on or not data_check.due(self.env.data_check_interval, self._steps):
            return
        group = getattr(self.engine.optimizer, "dp_process_group", None)
        if group is None:
            group = getattr(self.engine, "data_parallel_group", None)
        present = [t for t in self._sq if t is not None]
        # matches nothing; on the device the group's backend gathers on
        local = torch.full((1,), float("nan"), dtype=torch.float64,
                           device=_device(present, self.index))
        try:
            if present:
                local = torch.stack(present).sqrt()
        except Exception as exc:  # this rank still gathers: no peer is left waiting
            self.env.on_error("data", exc)
        try:
            self._fingerprint = data_check.launch(local, [group])
        except Exception as exc:
            self.env.on_error("data", exc)

    def _finish_reduced(self) -> NormVector | None:
        """The all-reduced norms of the step (the wait is a stream wait on a GPU, no host read)."""
        taken = self._sum.take()
        if taken is None:
            return None
        norms = taken.or_zeros(taken.values.sqrt()) / taken.context
        return NormVector(norms, self.index.all_positions, scaled=False)

    def _position_tensor(self, positions: list[int], device: torch.device) -> torch.Tensor:
        """The positions as a device index, built once (a host-to-device copy of a pageable
        list waits for the stream, so it is not repeated per step)."""
        key = (tuple(positions), device)
        cached = self._positions.get(key)
        if cached is None:
            if len(self._positions) > 4:  # positions are stable per engine; stay bounded
                self._positions.clear()
            cached = self._positions[key] = torch.tensor(positions, device=device)
        return cached

    def _reduced_pieces(self) -> tuple[list[torch.Tensor], list[int]]:
        """This rank's share of every reduced gradient (disjoint across ranks for ZeRO 1-3)."""
        opt, position = self.engine.optimizer, self.index.position
        tensors: list[torch.Tensor] = []
        positions: list[int] = []
        if self.facts.stage == 3:
            for gi, group in enumerate(opt.fp16_groups):
                for p, g in zip(group, opt.averaged_gradients[gi], strict=False):
                    if g is not None and id(p) in position:
                        tensors.append(g.detach())
                        positions.append(position[id(p)])
        elif self.facts.stage in (1, 2):
            for pos, p in enumerate(self.index.params):
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    # DeepSpeed's own attribute, the documented way to its fragment of p
                    slot = p._index_in_param_group  # noqa: SLF001
                    tensors.append(mapping.get_lp_grad_fragment(slot).detach())
                    positions.append(pos)
        else:
            for pos, p in enumerate(self.index.params):
                if p.grad is not None:
                    tensors.append(p.grad.detach())
                    positions.append(pos)
        return tensors, positions

    # ------------------------------------------------------------------ for the rerun (.rerun)
    def reduced_now(self) -> NormVector | None:
        """The step's reduced norms now (the all-reduce waited), kept for ``collect``."""
        if self._ready is None:
            self._ready = self._finish_reduced()
        return self._ready

    def local_now(self) -> NormVector | None:
        """This rank's local norms of the micro-batches so far (kept for ``collect``)."""
        present = [(i, t) for i, t in enumerate(self._sq) if t is not None]
        if not present:
            return None
        norms = torch.stack([t for _, t in present]).sqrt() / self._scale_used
        return NormVector(norms, [i for i, _ in present], scaled=False)

    def inflight(self) -> GradSummaries | None:
        """Exit path: this rank's local norms of the micro-batches seen so far (its tensor
        hooks), left in place."""
        local = self.local_now()
        return GradSummaries(local=local, local_complete=False) if local is not None else None

    def swap_local(self, squares: list | None = None) -> list:
        """Hand over the local squares so far and continue from ``squares`` (empty: None)."""
        taken = list(self._sq)
        self._sq[:] = squares if squares is not None else [None] * len(self._sq)
        return taken

    # ------------------------------------------------------------------ per step
    def collect(self) -> GradSummaries:
        reduced, self._ready = self._ready or self._finish_reduced(), None
        self._steps += 1
        fingerprint, self._fingerprint = self._fingerprint, None
        identical = data_check.identical_ranks(fingerprint, self.env.on_error)
        local = self.local_now()
        self._sq[:] = [None] * len(self._sq)
        return GradSummaries(reduced=reduced, local=local, local_complete=local is not None,
                             identical_ranks=identical)

    def markers(self, host: StepHost) -> list[Any]:
        return engine_markers(self, host)  # engine.step, the rerun around it, the floor

    def manifest_extra(self) -> dict[str, Any]:
        return {"deepspeed": self.facts.manifest()}

    def update_probe(self, optimizer: Any, settings: UpdateSettings, default: Any) -> Any:
        return engine_update_probe(self.engine, self.facts, settings, default)  # its own step

    def close(self) -> None:
        super().close()
        if self._comm is not None:
            self._comm.close()
            self._comm = None
        attached_engines.discard(self.engine)


def _local_norm(grad: torch.Tensor) -> torch.Tensor:
    """A float64 0-d norm of one micro-batch's gradient: on CPU in float32 rows added in
    float64, as ``per_param_norms`` does (overflows re-measured; reading a CPU scalar is not a
    device sync); on a GPU in float64."""
    if not host_read_free(grad.device):
        return torch.linalg.vector_norm(grad, dtype=torch.float64)
    return per_param_norms([grad])[0]


def _device(tensors: list[torch.Tensor], index) -> torch.device:
    if tensors:
        return tensors[0].device
    for p in index.params:
        return p.device
    return torch.device("cpu")
