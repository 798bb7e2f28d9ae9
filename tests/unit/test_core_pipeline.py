"""Pipeline parallel's record finish (``StageOrigin.finish``) at world size 1: two real
``PipelineStage``s on this one rank under ``ScheduleInterleaved1F1B``, attached with
``ddpmon.attach(parts, opt, schedule=)``. The global norm is checked against torch's
``get_total_norm`` over both stages, the per-stage origin against a NaN put into one stage; then
``StageOrigin.finish`` is called directly with hand-made read-back values for the cases a healthy
run never produces (a failed rank, an Inf total, an activation that turned NaN first)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ddpmon import host_reads
from ddpmon.agent.guard import Guard
from ddpmon.agent.records import StepMeta, build_record
from ddpmon.metrics.state import StepRecord
from ddpmon.probes.grads import NormVector
from ddpmon.strategies.base import GradSummaries
from ddpmon.strategies.pipeline.probes import NO_EVENT, PPStep, _all_finite

pipelining = pytest.importorskip("torch.distributed.pipelining")


@pytest.fixture(scope="module")
def pp(tmp_path_factory):
    """(monitor, stage modules, schedule, optimizer) of a 2-stage pipeline on one rank."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import ddpmon

    torch.manual_seed(0)
    first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    cpu = torch.device("cpu")
    stages = [pipelining.PipelineStage(first, 0, 2, cpu), pipelining.PipelineStage(last, 1, 2, cpu)]
    schedule = pipelining.ScheduleInterleaved1F1B(
        stages, n_microbatches=2, loss_fn=lambda out, target: (out - target).pow(2).mean()
    )
    opt = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1)
    mon = ddpmon.attach(
        [first, last], opt, schedule=schedule, port=0, run_dir=str(tmp_path_factory.mktemp("pp"))
    )
    try:
        yield mon, (first, last), schedule, opt
    finally:
        mon.close()
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_attempt(pp):
    """Every test starts with no stage poisoned (as after a restart)."""
    pp[0].source.origin.reset()
    yield


def test_global_norm_over_both_stages_and_the_nan_origin_per_stage(pp):
    mon, (first, last), schedule, opt = pp
    assert mon.enabled, mon.error
    gen = torch.Generator().manual_seed(3)
    expected = []
    for step in range(3):
        opt.zero_grad()
        hook = None
        if step == 1:  # stage 1's weight gradient turns NaN in this step only
            hook = last.weight.register_hook(lambda g: torch.full_like(g, math.nan))
        schedule.step(torch.randn(4, 4, generator=gen), target=torch.randn(4, 2, generator=gen))
        if hook is not None:
            hook.remove()
        grads = [p.grad for p in (*first.parameters(), *last.parameters())]
        expected.append(float(torch.nn.utils.get_total_norm(grads)))
        opt.step()
    clean, origin, poisoned = mon.recent_steps()[-3:]
    assert clean.grad_norm == pytest.approx(expected[0], rel=1e-6)
    assert not clean.origin and not clean.local_nonfinite
    assert origin.origin and math.isnan(origin.grad_norm)
    assert origin.pp_origin == {
        "stage": 1, "microbatch": None, "site": "param_grad", "param": "stage1.weight"
    }
    assert poisoned.poisoned and not poisoned.origin, "the NaN applied at step 1 poisoned step 2"


def finish(mon, parts, *, table=(), flags=(), local=None) -> StepRecord:
    """The record thread's work on one read-back step: ``build_record`` (the global norm's one
    writer, from ``PPStep.global_norm``, then the source's per-stage finish). ``local``: (host
    values, positions) of this rank's local norms."""
    step = PPStep(mon.source, torch.zeros(2), torch.tensor(flags), list(table), [0, 1])
    parts = {**parts, "pp_flags": list(flags)}  # the flags as read back with the step
    summaries = GradSummaries(extension=step)
    if local is not None:
        values, positions = local
        parts["local_norms"] = list(values)
        summaries.local = NormVector(torch.zeros(len(positions)), list(positions))
    meta = StepMeta(step=9, wall_time=0.0, duration=None, data_wait=None, summaries=summaries,
                    loss_host=None, trainer_norm_host=None, trainer_norm_step=None,
                    skipped_by=None)
    errors: list[str] = []
    record = build_record(parts, meta, mon.index, Guard(errors.append))
    assert errors == [], errors
    return record


def test_the_pp_sum_gives_the_norm_and_a_failure_gives_none(pp):
    mon = pp[0]
    assert finish(mon, {"pp_norm": [25.0, 0.0]}).grad_norm == pytest.approx(5.0)
    failed = finish(mon, {"pp_norm": [25.0, 1.0]})
    assert failed.grad_norm is None and not failed.grad_nonfinite
    inf = finish(mon, {"pp_norm": [math.inf, 0.0]})
    assert inf.grad_norm == math.inf and inf.grad_nonfinite


def test_an_activation_that_turned_nan_first_names_its_microbatch_and_site(pp):
    mon = pp[0]
    table = [(0, 0, "activation"), (0, 1, "activation"), (1, 1, "output")]
    # stage 0 produced a NaN at seq 1 (micro-batch 1) and received none; stage 1 received it
    flags = [NO_EVENT, 1.0, 1.0, 2.0]
    rec = finish(mon, {"pp_norm": [math.nan, 0.0]}, table=table, flags=flags)
    assert rec.origin and rec.local_nonfinite
    assert rec.pp_origin == {"stage": 0, "microbatch": 1, "site": "activation", "param": None}
    assert rec.local_nonfinite_param == "stage0.<activation>"
    # the NaN was applied (no skip): every later step of every stage is poisoned, not an origin
    later = finish(mon, {"pp_norm": [math.nan, 0.0]}, table=table, flags=flags)
    assert later.poisoned and not later.origin


def test_a_local_parameter_gradient_is_an_origin_after_every_activation(pp):
    mon = pp[0]
    names = mon.index.names
    bad = names.index("stage0.bias")
    values = [1.0] * len(names)
    values[bad] = math.inf
    rec = finish(
        mon, {"pp_norm": [4.0, 0.0]}, flags=[NO_EVENT] * 4,
        local=(values, list(range(len(names)))),
    )
    assert rec.origin
    assert rec.pp_origin["site"] == "param_grad" and rec.pp_origin["param"] == "stage0.bias"


def test_a_torch_without_batch_p2p_loses_only_the_send_recv_times(monkeypatch, caplog):
    """``schedules._batch_p2p`` is private: without it the P2P timing installs nothing and says
    so once, and never raises into attach."""
    from torch.distributed.pipelining import schedules

    from ddpmon.strategies.pipeline.probes import P2PTiming

    monkeypatch.delattr(schedules, "_batch_p2p")
    timing = P2PTiming(setup=None, recorder=None, on_error=None)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="ddpmon"):
        timing.install()
    assert not timing._installed
    assert any("_batch_p2p" in r.getMessage() for r in caplog.records)
    timing.uninstall()  # nothing to undo, no error


@pytest.mark.parametrize("audit", [False, True], ids=["cpu-read", "device-branch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_stage_probes_finite_check_finds_every_nonfinite_value_and_nothing_else(
    dtype, audit, monkeypatch
):
    """The per-micro-batch check (a float64 sum below float64; on CPU a float32 sum read
    first): NaN, +Inf and -Inf anywhere are found; the largest finite values, whose float32
    sum overflows, are not flagged. Both branches: the CPU's, and the one a GPU takes (the
    sync audit's)."""
    monkeypatch.setattr(host_reads, "_AUDIT", audit)
    big = torch.full((64, 256), torch.finfo(dtype).max, dtype=dtype)
    assert bool(_all_finite(big)) and bool(_all_finite(-big))
    assert bool(_all_finite(torch.zeros(0, dtype=dtype)))
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.randn(64, 256).to(dtype)
        t[17, 200] = bad
        assert not bool(_all_finite(t)), (dtype, bad)
