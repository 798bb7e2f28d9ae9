"""``DdpmonCallback`` for the ``pytorch_lightning`` package when ``lightning`` is installed too
(``ddpmon.integrations.lightning`` prefers ``lightning.pytorch``). Same behaviour."""

from __future__ import annotations

from typing import Any

from .lightning import callback_class

__all__ = ["DdpmonCallback"]  # noqa: F822 - provided lazily by __getattr__


def __getattr__(name: str) -> Any:
    if name == "DdpmonCallback":
        return callback_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
