"""Fault injection for the demo and the tests: ``KIND@[rankR:]stepS[:key=value...]``.

Kinds: nan, inf (into one parameter's gradient on one rank, at the step's first backward only:
a transient fault, which a rerun does not reproduce), bad-batch (NaN into that gradient at every
backward of the step: a batch that always fails, deterministic), bitflip (after the optimizer
step, flip bit ``bit`` (default 20) of element 0 of ``param`` on one rank: silent data
corruption of its weights), scale-collapse (inf gradients on
every step from S on, so GradScaler halves its scale each step), slow (sleep per step from S on:
a straggler), hang (stop before the backward pass), segv, kill (SIGKILL self), exit (code=N),
oom (a real CPU allocator failure), dup-data (from step S on this rank reads rank 0's shard),
grad-scale (from step S on, this rank's local gradients are multiplied by ``factor``, default 2,
before the all-reduce: the classic "loss averaged over the wrong denominator" bug).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the demo's CLI parses specs without torch; the ranks have it
    import torch

KINDS = (
    "nan",
    "inf",
    "scale-collapse",
    "slow",
    "hang",
    "segv",
    "kill",
    "exit",
    "oom",
    "dup-data",
    "grad-scale",
    "bad-batch",
    "bitflip",
)
DEFAULT_PARAM = "encoder.layers.0.linear1.weight"


class FaultSpecError(ValueError):
    pass


@dataclass(slots=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Fault:
        head, _, rest = spec.partition("@")
        if head not in KINDS:
            raise FaultSpecError(
                f"--inject {spec!r}: unknown fault {head!r}; one of {', '.join(KINDS)}"
            )
        rank, step, options = None, None, {}
        for part in filter(None, rest.split(":")):
            if part.startswith("rank") and part[4:].isdigit():
                rank = int(part[4:])
            elif part.startswith("step") and part[4:].isdigit():
                step = int(part[4:])
            elif "=" in part:
                key, value = part.split("=", 1)
                options[key] = value
            else:
                raise FaultSpecError(f"--inject {spec!r}: cannot read {part!r}")
        if step is None:
            raise FaultSpecError(f"--inject {spec!r}: needs a step, e.g. {head}@rank1:step20")
        return cls(head, step, rank, options)

    def applies(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


class FaultPlan:
    def __init__(self, specs: list[str], rank: int) -> None:
        self.faults = [f for f in (Fault.parse(s) for s in specs) if f.applies(rank)]
        self.rank = rank
        self._backwards: dict[int, int] = {}

    def data_rank(self, step: int) -> int:
        """Whose data shard this rank reads at ``step`` (dup-data makes it rank 0's)."""
        for fault in self.faults:
            if fault.kind == "dup-data" and step >= fault.step:
                return int(fault.options.get("source", "0"))
        return self.rank

    def before_backward(self, step: int, model: torch.nn.Module) -> None:
        """Called between forward and backward: gradient faults register one-shot hooks."""
        seen = self._backwards.get(step, 0)  # backwards of this step so far (a rerun: 1)
        self._backwards = {step: seen + 1}
        for fault in self.faults:
            active = step == fault.step or (
                fault.kind in ("scale-collapse", "slow", "grad-scale") and step >= fault.step
            )
            if not active:
                continue
            if fault.kind in ("nan", "inf") and seen:
                continue  # transient: the step's rerun computes clean gradients
            if fault.kind in ("nan", "inf", "scale-collapse", "bad-batch"):
                value = float("inf") if fault.kind in ("inf", "scale-collapse") else float("nan")
                name = fault.options.get("param", DEFAULT_PARAM)
                _poison_grad(model, name, value)
            elif fault.kind == "grad-scale":
                _scale_grads(model, float(fault.options.get("factor", "2")))
            elif fault.kind == "slow":
                time.sleep(float(fault.options.get("seconds", "0.2")))
            elif fault.kind == "hang":
                print(
                    f"[rank {self.rank}] injected hang at step {step}", file=sys.stderr, flush=True
                )
                while True:
                    time.sleep(3600)
            elif fault.kind == "segv":
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSEGV)
            elif fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "exit":
                sys.exit(int(fault.options.get("code", "1")))
            elif fault.kind == "oom":
                import torch  # torch-free start of the CLI and the daemon

                torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator refuses this


    def after_step(self, step: int, model: torch.nn.Module) -> None:
        """Called after the optimizer step: weight faults."""
        for fault in self.faults:
            if fault.kind == "bitflip" and step == fault.step:
                name = fault.options.get("param", DEFAULT_PARAM)
                flip_bit(model, name, int(fault.options.get("bit", "20")))


def flip_bit(model: torch.nn.Module, name: str, bit: int) -> None:
    """One bit of element 0 of an fp32 parameter, flipped in place: what a faulty GPU does."""
    inner = getattr(model, "module", model)
    params = dict(inner.named_parameters())
    if name not in params:
        raise FaultSpecError(f"no parameter {name!r}; e.g. {', '.join(list(params)[:4])}")
    import torch  # torch-free start of the CLI and the daemon

    with torch.no_grad():
        params[name].view(-1).view(torch.int32)[0] ^= 1 << bit


def _poison_grad(model: torch.nn.Module, name: str, value: float) -> None:
    inner = getattr(model, "module", model)
    params = dict(inner.named_parameters())
    if name not in params:
        raise FaultSpecError(f"no parameter {name!r}; e.g. {', '.join(list(params)[:4])}")
    param = params[name]
    handle = None

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        poisoned = grad.clone()
        poisoned.view(-1)[0] = value
        return poisoned

    handle = param.register_hook(hook)


def _scale_grads(model: torch.nn.Module, factor: float) -> None:
    """One-shot hooks multiplying every local gradient of this backward by ``factor`` (they run
    before DDP's reducer sees the gradient, so the all-reduce averages the scaled values)."""
    inner = getattr(model, "module", model)
    for param in inner.parameters():
        if param.requires_grad:
            _scale_once(param, factor)


def _scale_once(param: torch.Tensor, factor: float) -> None:
    handle = None

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return grad * factor

    handle = param.register_hook(hook)
