"""One strategy registry (``ddpmon.strategies.registry``): every row's source exists and is a
gradient source, and the other layers' views of the strategies are read from it, not kept
apart."""

from __future__ import annotations

import importlib

from ddpmon.export import collector
from ddpmon.strategies import registry
from ddpmon.strategies.base import GradientSource


def test_every_row_names_a_gradient_source():
    for name, row in registry.STRATEGIES.items():
        module, _, cls = row.source.partition(":")
        source = getattr(importlib.import_module(module), cls)
        assert issubclass(source, GradientSource), name
        assert registry.SOURCES[name] == row.source


def test_the_other_layers_read_the_registry():
    assert registry.SHARDED_KINDS == registry.SHARDED == ("fsdp2", "hsdp", "tp", "fsdp2+tp",
                                                          "hsdp+tp")
    assert collector.reduced_norms_identical is registry.reduced_norms_identical
    assert registry.reduced_norms_identical("deepspeed-zero3")
    assert registry.reduced_norms_identical("hsdp+tp")
    assert not registry.reduced_norms_identical("plain")
    assert not registry.reduced_norms_identical("unsupported:fsdp1")
