"""``DeepSpeedSource`` at world size 1, in this process: a real ``deepspeed.initialize`` engine
per ZeRO stage on DeepSpeed's CPU accelerator (gloo), attached with ``ddpmon.attach(engine)``.
Its norms are checked against DeepSpeed's own ``get_global_grad_norm`` and against a float64
norm of the full gradients (``safe_get_full_grad``), a failed reading against the failure slot.
The cross-rank parts (the all-reduce over two ranks, the NaN origin) are tests/parallel's.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
from deepspeed.utils import safe_get_full_grad  # noqa: E402

import ddpmon  # noqa: E402

STEPS = 3
GAS = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world, set up as a launcher would for DeepSpeed (LOCAL_RANK, ...)."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this worker")
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield tmp_path_factory.mktemp("ds-runs")
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def engine_for(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)  # 5 rows: ZeRO-3 pads
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.01,  # below every norm: clipping changes the gradients
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train(engine, steps: int = STEPS) -> tuple[list[float], list[float | None]]:
    """(float64 norms of the full pre-clip gradients, DeepSpeed's own norms) per step."""
    gen = torch.Generator().manual_seed(1)
    reference, theirs = [], []
    for _ in range(steps):
        for micro in range(GAS):
            loss = engine(torch.randn(4, 8, generator=gen)).pow(2).mean()
            engine.backward(loss)
            if micro == GAS - 1:
                grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
                reference.append(
                    math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
                )
            engine.step()
        value = engine.get_global_grad_norm()
        theirs.append(None if value is None else float(value))
    return reference, theirs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_global_norm_equals_deepspeeds_and_the_full_gradients(world, stage):
    engine = engine_for(stage)
    mon = ddpmon.attach(engine, port=0, run_dir=str(world), run_id=f"z{stage}")
    try:
        assert mon.enabled, mon.error
        assert mon.source.name == f"deepspeed-zero{stage}"
        reference, theirs = train(engine)
        records = mon.recent_steps()
    finally:
        mon.close()
    assert [r.step for r in records] == list(range(STEPS)), "one step per engine boundary"
    ours = [r.grad_norm for r in records]
    assert ours == pytest.approx(reference, rel=1e-5)
    if stage > 0:  # ZeRO 1-3 report their own pre-clip norm (stage 0 returns None)
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert all(r.grad_local_norm is not None and r.grad_local_norm > 0 for r in records)
    assert mon.state.agent_errors.get("grads", 0) == 0


def test_a_failed_reading_reports_zero_for_that_step_and_training_goes_on(world, monkeypatch):
    engine = engine_for(2)
    mon = ddpmon.attach(engine, port=0, run_dir=str(world), run_id="z2-fail")
    try:
        assert mon.enabled, mon.error
        calls = {"n": 0}
        real = mon.source._reduced_pieces

        def fails_at_step_1():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected: the partition could not be read")
            return real()

        monkeypatch.setattr(mon.source, "_reduced_pieces", fails_at_step_1)
        reference, _ = train(engine)
        records = mon.recent_steps()
        errors = mon.state.agent_errors.get("grads", 0)
    finally:
        mon.close()
    norms = [r.grad_norm for r in records]
    assert len(norms) == STEPS
    assert norms[1] == 0.0, "the failure slot makes the step report 0, never NaN"
    assert norms[0] == pytest.approx(reference[0], rel=1e-5)
    assert norms[2] == pytest.approx(reference[2], rel=1e-5)
    assert errors == 1


@pytest.mark.parametrize("attach", ["before", "after"])
def test_a_load_checkpoint_resume_numbers_steps_as_the_engine_does(world, tmp_path, attach):
    """``engine.load_checkpoint`` restores ``global_steps``: the resumed steps are numbered
    from it, whether ddpmon was attached before or after the load."""
    trained = engine_for(2)
    train(trained)
    assert trained.global_steps == STEPS
    trained.save_checkpoint(str(tmp_path), tag="ckpt")
    trained.destroy()
    engine = engine_for(2)
    mon = None
    if attach == "before":
        mon = ddpmon.attach(engine, port=0, run_dir=str(world), run_id=f"ds-resume-{attach}")
    engine.load_checkpoint(str(tmp_path), tag="ckpt")
    assert engine.global_steps == STEPS
    if mon is None:
        mon = ddpmon.attach(engine, port=0, run_dir=str(world), run_id=f"ds-resume-{attach}")
    try:
        train(engine, steps=2)
        records = mon.recent_steps()
    finally:
        mon.close()
        engine.destroy()
    assert [r.step for r in records] == [STEPS, STEPS + 1], [r.step for r in records]
