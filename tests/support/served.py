"""Served one-rank monitors for the MFU tests (tests/unit/test_mfu*.py): their ``attached``
fixture yields from ``served_monitors``."""

from __future__ import annotations

import torch

import ddpmon
from tests.support.ports import free_port


def served_monitors(tmp_path):
    """``attach(model, **options)`` -> ``(mon, optimizer, port)``: a one-rank monitor serving
    /metrics on a free loopback port, SGD on the model; every one closed after the test."""
    made = []

    def attach(model, **options):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        port = free_port()
        mon = ddpmon.attach(model, opt, port=port, bind="127.0.0.1", run_dir=str(tmp_path),
                            run_id=f"m{len(made)}", linger_seconds=0, goodput_seconds=0,
                            **options)
        assert mon.enabled, mon.error
        made.append(mon)
        return mon, opt, port

    yield attach
    for mon in made:
        mon.close()
