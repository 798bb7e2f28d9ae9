"""The integrations' small parts with the real libraries, in one process (no training run)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support.integrations import REPO


def test_import_ddpmon_imports_no_framework() -> None:
    code = (
        "import sys, ddpmon, ddpmon.integrations, ddpmon.integrations.accelerate\n"
        "loaded = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate')"
        " if m in sys.modules]\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                          capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stdout  # checked here: an -O child keeps no assert


def test_lightning_callback_refuses_an_unknown_package() -> None:
    # Both packages are exercised by the 2-rank runs (test_lightning.py); this checks the choice.
    from ddpmon.integrations import lightning as integ

    with pytest.raises(ValueError, match="package must be one of"):
        integ.callback_class("torch")


def test_transformers_callback_rejects_a_non_trainer() -> None:
    from transformers import TrainerCallback

    from ddpmon.integrations.transformers import DdpmonCallback

    assert isinstance(DdpmonCallback(port=0), TrainerCallback)
    with pytest.raises(TypeError, match="transformers.Trainer"):
        DdpmonCallback(trainer=object())


def test_parts_from_accelerator_and_the_inner_optimizer() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from ddpmon.integrations.accelerate import parts_from_accelerator, unwrap_optimizer

    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        parts = parts_from_accelerator(accelerator)
        assert parts["scaler"] is None  # no fp16 GradScaler on CPU
        assert parts["gradient_accumulation_steps"] == 3
        assert parts["mixed_precision"] == "no"
        assert parts["num_processes"] == 1 and parts["process_index"] == 0
        assert parts["distributed_type"] == "NO"
        inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        prepared = accelerator.prepare(inner)
        assert prepared is not inner
        assert unwrap_optimizer(prepared) is inner
        assert unwrap_optimizer(inner) is inner
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        parts_from_accelerator(object())
