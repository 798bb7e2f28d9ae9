"""Every private torch access behind ``ddpmon._torch_compat``, one test each: the access exists in
the torch under test and does what ddpmon relies on (a torch upgrade that renames or removes it
fails here, in CI, not in a user's run), and where it is missing the fallback keeps the numbers or
loses only its one feature, said once with the torch version and counted every time."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ddpmon import _torch_compat
from ddpmon import _torch_compat as compat


@pytest.fixture(autouse=True)
def fresh_counts(monkeypatch):
    monkeypatch.setattr(compat, "LOST", compat.LOST.__class__())


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no" in r.getMessage()]


def lose_attribute(monkeypatch, owner, name: str) -> None:
    """``owner`` as a torch without ``name`` would have it (instances and classes alike)."""
    monkeypatch.delattr(owner, name)


# ---------------------------------------------------------------------------- autograd engine
def test_queue_backward_callback_runs_after_the_backward_pass():
    seen: list[str] = []
    w = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        seen.append("hook")
        assert compat.queue_backward_callback(lambda: seen.append("end"))

    w.register_hook(hook)
    (w * 2).sum().backward()
    assert seen == ["hook", "end"] and not compat.LOST


def test_without_the_execution_engine_nothing_is_queued_and_it_is_said_once(monkeypatch, caplog):
    lose_attribute(monkeypatch, torch.autograd.Variable, "_execution_engine")
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        assert compat.queue_backward_callback(lambda: None) is False
        assert compat.queue_backward_callback(lambda: None) is False
    assert compat.LOST["Variable._execution_engine.queue_callback"] == 2
    assert len(said(caplog)) == 1 and torch.__version__ in said(caplog)[0]


# ---------------------------------------------------------------------------- tensors
def test_version_counts_in_place_changes():
    t = torch.zeros(2)
    before = compat.version(t)
    t.add_(1)
    assert compat.version(t) == before + 1 and not compat.LOST
    assert compat.version(SimpleNamespace()) == -1  # a tensor-like without the counter
    assert compat.LOST["Tensor._version"] == 1


def test_foreach_norm_equals_vector_norm_and_falls_back_alike(monkeypatch, caplog):
    tensors = [torch.randn(5), torch.randn(3, 4)]
    want = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
    fused = compat.foreach_norm(tensors, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(fused, want, strict=True)) and not compat.LOST
    lose_attribute(monkeypatch, torch, "_foreach_norm")
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        slow = compat.foreach_norm(tensors, torch.float64)
        compat.foreach_norm(tensors, None)
    assert all(torch.equal(a, b) for a, b in zip(slow, want, strict=True))
    assert compat.LOST["torch._foreach_norm(dtype=)"] == 2 and len(said(caplog)) == 1


# ---------------------------------------------------------------------------- DTensor
def test_dtensor_local_piece_and_placements_without_the_private_fields(mesh, monkeypatch):
    """The fast path and the public one give the same piece and placements, and so the same
    norms (``dtensor_norms.raw_local`` and ``has_partial`` are these two)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    grad = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
    assert compat.dtensor_local(grad) is grad._local_tensor
    assert compat.dtensor_placements(grad) == tuple(grad.placements) and not compat.LOST
    # a torch whose DTensor lacks both: the public path, the same values
    real_getattr = getattr

    def without_private(obj, name, *default):  # torch itself still reads them
        if isinstance(obj, DTensor) and name in ("_local_tensor", "_spec"):
            return default[0] if default else None
        return real_getattr(obj, name, *default)

    monkeypatch.setattr(_torch_compat, "getattr", without_private, raising=False)
    assert torch.equal(compat.dtensor_local(grad), grad.to_local())
    assert compat.dtensor_placements(grad) == (Shard(0),)
    assert set(compat.LOST) == {"DTensor._local_tensor", "DTensor._spec"}


# ---------------------------------------------------------------------------- GradScaler
def test_scaler_state_says_when_unscale_ran(monkeypatch):
    from torch.amp.grad_scaler import OptState

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert compat.scaler_state(scaler, opt).get("stage") is not OptState.UNSCALED
    scaler.unscale_(opt)
    state = compat.scaler_state(scaler, opt)
    assert state["stage"] is OptState.UNSCALED and "found_inf_per_device" in state
    lose_attribute(monkeypatch, scaler, "_per_optimizer_states")
    assert compat.scaler_state(scaler, opt) is None
    assert compat.LOST["GradScaler._per_optimizer_states"] == 1


# ---------------------------------------------------------------------------- FSDP2
def test_fsdp_param_groups_and_the_all_reduce_hook(mesh, monkeypatch):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    groups = compat.fsdp_param_groups(model)
    assert len(groups) == 1 and hasattr(groups[0], "_all_reduce_hook")
    marker = object()
    compat.set_all_reduce_hook(groups[0], marker)
    assert groups[0]._all_reduce_hook is marker and not compat.LOST
    compat.set_all_reduce_hook(SimpleNamespace(), marker)  # a group without the field
    assert compat.LOST["FSDPParamGroup._all_reduce_hook"] == 1
    lose_attribute(monkeypatch, FSDPModule, "_get_fsdp_state")
    assert compat.fsdp_param_groups(model) == []
    assert compat.LOST["FSDPModule._get_fsdp_state"] == 1


# ---------------------------------------------------------------------------- pipelining
def test_batch_p2p_is_the_schedules_send_recv_call(monkeypatch):
    from torch.distributed.pipelining import schedules

    original = compat.batch_p2p()
    assert callable(original) and original is schedules._batch_p2p

    def replacement(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(schedules, "_batch_p2p", schedules._batch_p2p)  # restored after
    compat.set_batch_p2p(replacement)
    assert schedules._batch_p2p is replacement and compat.batch_p2p() is replacement
    lose_attribute(monkeypatch, schedules, "_batch_p2p")
    assert compat.batch_p2p() is None
    assert compat.LOST["pipelining.schedules._batch_p2p"] == 1


# ---------------------------------------------------------------------------- GradScaler fields
def test_scaler_enabled_and_its_scale_tensor(monkeypatch):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    assert compat.scaler_enabled(scaler)
    assert not compat.scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))
    scaler.scale(torch.ones(1))  # the scale tensor is made lazily, at the first scale()
    scale = compat.scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == 256.0 and not compat.LOST
    lose_attribute(monkeypatch, scaler, "_scale")
    lose_attribute(monkeypatch, scaler, "_enabled")
    assert compat.scaler_scale(scaler) is None and compat.scaler_enabled(scaler)
    assert set(compat.LOST) == {"GradScaler._scale", "GradScaler._enabled"}


# ---------------------------------------------------------------------------- torch.compile
def test_compiled_inner_is_the_users_module():
    module = torch.nn.Linear(2, 2)
    compiled = torch.compile(module)
    assert compat.compiled_inner(compiled) is module
    assert compat.compiled_inner(module) is None


# ---------------------------------------------------------------------------- pipelining
def test_schedule_stages_and_microbatches(mesh):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=3, loss_fn=lambda out, y: out.sum())
    assert compat.schedule_stages(schedule) == [stage]
    assert compat.schedule_microbatches(schedule) == 3 and not compat.LOST
    assert compat.schedule_stages(SimpleNamespace()) == []
    assert compat.schedule_microbatches(SimpleNamespace()) == 1
    assert set(compat.LOST) == {"PipelineSchedule._stages", "PipelineSchedule._n_microbatches"}


# ---------------------------------------------------------------------------- FSDP2 group
def test_fsdp_group_comms_are_readable(mesh):
    from torch.distributed.fsdp import fully_shard

    group = compat.fsdp_param_groups(fully_shard(torch.nn.Linear(4, 4), mesh=mesh))[0]
    for name in ("_reduce_scatter_comm", "_all_gather_comm", "_all_reduce_hook", "_is_hsdp"):
        assert hasattr(group, name), name
    reduce_scatter, all_gather, hook, hsdp = compat.fsdp_group_comms(group)
    assert reduce_scatter is not None and all_gather is not None
    assert hook is None and hsdp is False


# ---------------------------------------------------------------------------- c10d, DCP
def test_flight_recorder_dump_functions_exist():
    dump_pickle, dump_json = compat.flight_recorder_dumps()
    assert callable(dump_pickle) and callable(dump_json)


def test_dcp_logger_once_dcp_is_imported():
    import torch.distributed.checkpoint  # noqa: F401

    logger = compat.dcp_logger()
    assert isinstance(logger, logging.Logger) and not compat.LOST
