"""Max-logit module labels: a ``logit_modules`` name is user text; it is exported cleaned (no
raw control character) and capped, while the hook still finds the module by its real name."""

from __future__ import annotations

import torch

from ddpmon.probes.logits import MAX_LABEL_CHARS, LogitProbe


def test_a_hostile_module_name_is_exported_cleaned_and_capped():
    model = torch.nn.Module()
    long_name = "head\x1b[31m\n" + "x" * 500
    model.add_module(long_name, torch.nn.Linear(4, 4))
    probe = LogitProbe(model, [long_name], lambda name, exc: None)
    (label,) = probe.names
    assert len(label) <= MAX_LABEL_CHARS
    assert not any(ord(c) < 32 or ord(c) == 127 for c in label)
    assert label.endswith("x" * 100)
    getattr(model, long_name)(torch.randn(2, 4, requires_grad=True))
    values = probe.take()
    assert values is not None and values.numel() == 1
