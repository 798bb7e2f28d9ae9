"""The fused gradient pass: norms, groups, first non-finite parameter, overflow vs Inf."""

import math

import pytest
import torch
from torch import nn

from ddpmon.probes.grads import ParamIndex, full_pass, per_param_norms, summarize_host


def _summary(index):
    vector = full_pass(index)
    return summarize_host(vector, vector.norms.tolist(), index)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)


def _grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_norms_match_torch_and_groups_partition_the_total():
    model = Net()
    _grads(model)
    index = ParamIndex(model, group_depth=1)
    summary = _summary(index)
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in model.parameters()])
    ).item()
    assert summary.norm == pytest.approx(expected, rel=1e-6)
    assert index.group_names == ["encoder", "head"]
    enc = torch.cat([p.grad.flatten() for p in model.encoder.parameters()]).norm().item()
    assert summary.group_norms[0] == pytest.approx(enc, rel=1e-6)
    assert math.sqrt(sum(g * g for g in summary.group_norms)) == pytest.approx(expected, rel=1e-6)
    assert not summary.nonfinite and summary.first_position == -1


def test_first_nonfinite_is_first_in_backward_order_with_its_kind():
    """Before any backward has been seen, backward order is reverse registration order: the
    module registered last (nearest the loss) first (tests/unit/test_backward_order.py has the
    measured order)."""
    model = Net()
    _grads(model)
    model.head.weight.grad[0, 0] = float("inf")
    model.encoder[1].bias.grad[3] = float("nan")
    index = ParamIndex(model)
    summary = _summary(index)
    assert summary.nonfinite
    assert index.names[summary.first_position] == "head.weight"
    assert summary.kind == "inf"
    model.head.weight.grad[0, 0] = 0.0
    summary = _summary(index)
    assert index.names[summary.first_position] == "encoder.1.bias" and summary.kind == "nan"


def test_huge_finite_gradient_is_not_called_nonfinite():
    # float32 squares overflow for |g| > ~1.8e19: the plain norm is inf although nothing is.
    grad = torch.full((16,), 1e20, dtype=torch.float32)
    assert math.isinf(torch._foreach_norm([grad])[0].item())
    norms = per_param_norms([grad])
    assert math.isfinite(norms[0].item())
    assert norms[0].item() == pytest.approx(4e20, rel=1e-6)


def test_groups_are_bounded_and_fold_into_other():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    _grads(model)
    index = ParamIndex(model, group_depth=1, max_groups=4)
    assert index.group_names == ["0", "1", "2", "other"]
    summary = _summary(index)
    assert len(summary.group_norms) == 4
    assert math.sqrt(sum(g * g for g in summary.group_norms)) == pytest.approx(summary.norm)


def test_params_without_grad_are_skipped():
    model = Net()
    _grads(model)
    model.head.weight.grad = None
    index = ParamIndex(model)
    summary = _summary(index)
    expected = (
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        .norm()
        .item()
    )
    assert summary.norm == pytest.approx(expected, rel=1e-6)


def test_stacked_small_gradients_give_the_same_norms_per_parameter():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(2, 2))
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    model.register_parameter("shift", nn.Parameter(torch.tensor(0.5)))  # 0-dim, stacked too
    _grads(model, seed=3)
    index = ParamIndex(model)
    plan = index.stack_plan
    assert plan is not None and sorted(plan.order) == list(range(len(index)))
    assert any(len(group) > 1 for group in plan.stacks)
    vector = full_pass(index)
    ours = dict(zip(vector.positions, vector.norms.tolist(), strict=True))
    grads = [p.grad for p in index.params]
    theirs = [float(torch.linalg.vector_norm(g.double())) for g in grads]  # torch's, in fp64
    assert ours == {i: pytest.approx(theirs[i], rel=1e-6) for i in range(len(grads))}
    # An overflow inside a stacked group is re-measured for that tensor only.
    model[1].weight.grad.fill_(1e20)
    vector = full_pass(index)
    ours = dict(zip(vector.positions, vector.norms.tolist(), strict=True))
    assert ours[index.names.index("1.weight")] == pytest.approx(8e20, rel=1e-6)
    assert all(math.isfinite(v) for v in ours.values())


def test_no_stack_plan_without_repeated_small_shapes():
    assert ParamIndex(nn.Linear(8, 4)).stack_plan is None  # weight and bias differ
    assert ParamIndex(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))).stack_plan.rest


def _mixed(shape, seed: int) -> torch.Tensor:
    """Gradient values whose magnitudes span e^+-6: a float32 running sum drifts on them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))


def _rel(ours: float, reference: float) -> float:
    return abs(ours - reference) / reference


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(_mixed(3 * 10**6 + 7, 1), id="long-with-tail"),
        pytest.param(_mixed((2048, 1024), 2), id="2d"),
        pytest.param(_mixed((1024, 2048), 3).t(), id="transposed"),
        pytest.param(_mixed((2, 2**20), 4)[:, : 2**19], id="strided-rows"),
        pytest.param(_mixed(10**6, 5).bfloat16(), id="bf16"),
        pytest.param(_mixed(10**6, 6).double(), id="fp64"),
    ],
)
def test_cpu_norms_equal_fp64_within_1e_7_where_float32_drifts(tensor):
    reference = float(tensor.double().norm())
    assert _rel(float(per_param_norms([tensor])[0]), reference) <= 1e-7
    if tensor.dtype is torch.float32 and tensor.numel() >= 10**6:
        assert _rel(float(torch.linalg.vector_norm(tensor)), reference) > 1e-6  # the drift


def test_stacked_small_gradients_stay_float32_and_unique_small_ones_are_exact():
    """Same-shaped small tensors (the host-cost path of small models) keep one float32
    reduction each: within a float32 sum's drift, not 1e-7. A small tensor of a shape of its
    own is reduced in float64."""
    model = nn.Sequential(*[nn.Linear(90, 90) for _ in range(6)], nn.Linear(90, 40))
    for i, p in enumerate(model.parameters()):
        p.grad = _mixed(p.shape, 10 + i)
    index = ParamIndex(model)
    assert index.stack_plan is not None
    vector = full_pass(index)
    lone = index.names.index("6.weight")  # 3,600 values, no other tensor of its shape
    assert lone in index.stack_plan.rest
    for position, ours in zip(vector.positions, vector.norms.tolist(), strict=True):
        reference = float(index.params[position].grad.double().norm())
        assert _rel(ours, reference) <= (1e-12 if position == lone else 1e-6), position


def test_plain_attach_global_and_group_norms_equal_fp64_within_1e_7(tmp_path):
    import ddpmon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))  # 8.4M
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    mon = ddpmon.attach(model, opt, port=0, run_dir=str(tmp_path), announce=False)
    references = []
    for step in range(2):
        x = _mixed((8, 1024), 100 + step)
        model(x).square().mean().backward()
        squares = {
            group: sum(
                float(p.grad.double().square().sum())
                for n, p in model.named_parameters() if n.startswith(f"{group}.")
            )
            for group in ("0", "2")
        }
        references.append(squares)
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.flush()
    records = mon.recent_steps()
    mon.close()
    assert [r.step for r in records] == [0, 1]
    for record, squares in zip(records, references, strict=True):
        assert _rel(record.grad_norm, math.sqrt(sum(squares.values()))) <= 1e-7
        for group, sq in squares.items():
            assert _rel(record.group_norms[group], math.sqrt(sq)) <= 1e-7


def test_stacked_norms_reuse_their_buffers_without_changing_a_bit():
    """The stacks' buffers are reused step after step: the norms are bit for bit those of a
    fresh stack and reduction, a result kept from one step is not overwritten by the next, and
    a change of dtype rebuilds the buffers."""
    from ddpmon.probes.stacked import stacked_norms

    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    index = ParamIndex(model)
    plan = index.stack_plan
    kept = []
    for seed in (1, 2):
        _grads(model, seed=seed)
        grads = [p.grad for p in index.params]
        fresh = torch.cat([stacked_norms([grads[i] for i in g]) for g in plan.stacks])
        vector = full_pass(index)
        assert torch.equal(vector.norms, fresh)
        kept.append((vector.norms, fresh))
    assert all(torch.equal(ours, theirs) for ours, theirs in kept)  # step 1's survived step 2
    assert not torch.equal(kept[0][0], kept[1][0])
    with plan.buffers._lock:  # held by another thread: the allocating path, the same bits
        assert torch.equal(full_pass(index).norms, kept[1][1])
    model.double()  # the same parameters, now float64
    for p in model.parameters():
        p.grad = torch.randn(p.shape, dtype=torch.float64)
    grads = [p.grad for p in index.params]
    first = full_pass(index).norms  # float64 gradients: still a copy, not the buffer
    assert first.tolist() == pytest.approx([float(grads[i].norm()) for i in plan.order], rel=1e-12)
    before = first.clone()
    for p in model.parameters():
        p.grad.mul_(2)
    assert torch.equal(full_pass(index).norms, 2 * before) and torch.equal(first, before)
