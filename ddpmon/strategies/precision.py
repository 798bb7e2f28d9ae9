"""The precision a run really trains in, read from where it is decided: DeepSpeed's config, FSDP2's
``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``), the parameters' own dtype, autocast
(seen at the first forward, inside the user's ``torch.autocast``) and the GradScaler.

Two forms: the manifest's ``precision`` (a short label, what ``ddpmon compare`` and the report
compare) with ``precision_detail`` (each fact and where it came from), and the same label on
``ddpmon_rank_info{precision}``. The label's values are bounded (:data:`LABELS`): a dtype from
:data:`DTYPES`, ``amp-<dtype>`` under autocast, ``+gradscaler`` with an enabled scaler,
``deepspeed-<fp32|bf16|fp16>``. Host facts only, read at attach and at the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._torch_compat import fsdp_mp_policy, scaler_enabled

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float64: "fp64"}
"""Label names of the floating dtypes; any other (fp8 kinds, integer parameters) is ``other``."""
_NAMES = (*DTYPES.values(), "other")
LABELS = (
    *_NAMES,
    *(f"amp-{n}" for n in _NAMES),
    *(f"{n}+gradscaler" for n in _NAMES),
    *(f"amp-{n}+gradscaler" for n in _NAMES),
    *(f"deepspeed-{n}" for n in ("fp32", "bf16", "fp16")),
)
"""Every value ``ddpmon_rank_info{precision}`` can take."""


def dtype_name(dtype: Any) -> str:
    return DTYPES.get(dtype, "other")


@dataclass(slots=True)
class Precision:
    """The facts, and the metric state whose ``precision`` label they set."""

    params: str
    """The dtype the model computes its parameters in (FSDP2's ``param_dtype``, else theirs)."""
    params_from: str
    """``fsdp2 MixedPrecisionPolicy``, ``parameters`` or ``deepspeed config``."""
    storage: str
    """The parameters' own dtype (what the optimizer updates)."""
    reduce: str | None = None
    """FSDP2's ``reduce_dtype`` (gradients reduced in it), where a policy sets one."""
    autocast: str | None = None
    """The autocast dtype the first forward ran under (None: no autocast, or not seen yet)."""
    autocast_seen: bool = False
    scaler: bool = False
    deepspeed: str | None = None
    state: Any = None
    """The ``MetricState`` whose ``precision`` label follows (set by :func:`read_precision`)."""
    device_type: str = "cpu"

    def label(self) -> str:
        """The bounded label (:data:`LABELS`)."""
        if self.deepspeed is not None:
            return f"deepspeed-{self.deepspeed}"
        base = f"amp-{self.autocast}" if self.autocast else self.params
        return f"{base}+gradscaler" if self.scaler else base

    def manifest(self) -> dict:
        return {
            "params": self.params,
            "params_from": self.params_from,
            "storage": self.storage,
            "reduce": self.reduce,
            "autocast": self.autocast if self.autocast_seen else "not seen yet",
            "gradscaler": self.scaler,
            "deepspeed": self.deepspeed,
        }


def read_precision(model: torch.nn.Module, params: list[torch.Tensor], scaler: Any,
                   engine_facts: Any, state: Any, device: str) -> Precision:
    """What attach can tell (autocast comes at the first forward: :func:`saw_forward`); sets
    ``state.precision``."""
    storage = _common([p.dtype for p in params])
    deepspeed = getattr(engine_facts, "precision", None)
    out = Precision(params=storage, params_from="parameters", storage=storage,
                    scaler=scaler is not None and scaler_enabled(scaler), deepspeed=deepspeed,
                    state=state, device_type=str(device).split(":", 1)[0] or "cpu")
    if deepspeed is not None:
        out.params, out.params_from = deepspeed, "deepspeed config"
    else:
        _read_fsdp2_policy(model, out)
    if state is not None:
        state.precision = out.label()
    return out


def _read_fsdp2_policy(model: torch.nn.Module, out: Precision) -> None:
    """FSDP2's ``param_dtype`` (the dtype its all-gathered parameters compute in) and
    ``reduce_dtype``, where its policy sets them."""
    policy = fsdp_mp_policy(model)
    if policy is None:
        return
    param_dtype = getattr(policy, "param_dtype", None)
    reduce_dtype = getattr(policy, "reduce_dtype", None)
    if param_dtype is not None:
        out.params, out.params_from = dtype_name(param_dtype), "fsdp2 MixedPrecisionPolicy"
    if reduce_dtype is not None:
        out.reduce = dtype_name(reduce_dtype)


def saw_forward(precision: Precision) -> None:
    """Note the autocast state of the first forward, starting now (inside the user's autocast
    context), and update the label. Later forwards: one attribute check."""
    if precision.autocast_seen:
        return
    precision.autocast_seen = True
    dtype = autocast_dtype(precision.device_type)
    precision.autocast = dtype_name(dtype) if dtype is not None else None
    if precision.state is not None and precision.deepspeed is None:
        precision.state.precision = precision.label()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type`` now, None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            on = torch.is_autocast_cpu_enabled()
            return torch.get_autocast_cpu_dtype() if on else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _common(dtypes: list[torch.dtype]) -> str:
    """The parameters' dtype: the one most of them have (by count; fp32 for none)."""
    if not dtypes:
        return "fp32"
    counts: dict[torch.dtype, int] = {}
    for d in dtypes:
        counts[d] = counts.get(d, 0) + 1
    return dtype_name(max(counts, key=counts.__getitem__))
