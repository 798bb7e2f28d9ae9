"""Which strategy a model is trained with, decided once at attach (docs/architecture.md).

``SOURCES`` maps a strategy name to its gradient source (``module:Class``, imported lazily so
that FSDP2/DTensor code is only loaded where it is used). A model ddpmon cannot analyse
(FSDP1; a pipelining module attached without ``schedule=``) gets one warning and local numbers
only. Pipeline parallel proper goes through ``attach(model_parts, opt, schedule=)``
(``pipeline``).
"""

from __future__ import annotations

import importlib
import logging

import torch

from .base import GradientSource, SourceEnv
from .deepspeed.source import is_engine
from .table import STRATEGIES

log = logging.getLogger("ddpmon")

SOURCES: dict[str, str] = {name: s.source for name, s in STRATEGIES.items()}
"""Strategy name -> its source's ``module:Class`` (from :mod:`.table`)."""


PIPELINE_HINT = (
    "ddpmon: a torch.distributed.pipelining module was attached without its schedule; "
    "attach the stage modules with ddpmon.attach(model_parts, optimizer, schedule=schedule) "
    "(docs/parallelism.md, Pipeline parallel). Reporting this rank's local numbers only."
)


def detect_strategy(model: torch.nn.Module) -> str:
    """plain | ddp | fsdp2 | hsdp | tp | fsdp2+tp | deepspeed | unsupported:<what>
    (``deepspeed``: a ``DeepSpeedEngine``; its source labels itself ``deepspeed-zero<stage>``)."""
    kind = type(model).__module__ + "." + type(model).__name__

    if is_engine(model):
        if type(model).__name__ == "PipelineEngine":
            return "unsupported:deepspeed-pipeline"
        return "deepspeed"
    if "deepspeed" in kind.lower():
        return "unsupported:deepspeed"
    if "pipelining" in kind.lower():
        return "unsupported:pipeline-parallel"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    try:  # the sharded strategies live in their own module (it knows their details)
        from .fsdp.source import detect_sharded  # guarded: torch builds without FSDP2
    except ImportError:
        detect_sharded = None
    if detect_sharded is not None:
        sharded = detect_sharded(model)
        if sharded:
            return sharded
    return "plain"


def make_source(strategy: str, env: SourceEnv) -> GradientSource:
    target = SOURCES.get(strategy)
    if strategy == "unsupported:pipeline-parallel":
        log.warning(PIPELINE_HINT)
        target = SOURCES["plain"]
    if target is None:
        log.warning(
            "ddpmon: %s is not supported yet; reporting this rank's local gradient numbers only "
            "(no global norm across ranks, no origin analysis).",
            strategy.split(":", 1)[-1],
        )
        target = SOURCES["plain"]
    module_name, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        log.warning("ddpmon: no gradient source for %s (%s); local numbers only", strategy, exc)
        cls = importlib.import_module("ddpmon.strategies.plain").PlainSource
    return cls(env)
