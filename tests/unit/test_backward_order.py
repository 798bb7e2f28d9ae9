"""The origin is the first non-finite gradient in backward order, measured once by one-shot
hooks (ddpmon/probes/backward_order.py), the same through the small and the numpy summary."""

from __future__ import annotations

import torch
from torch import nn

from ddpmon.probes.grads import ParamIndex, full_pass, summarize_host


class Shuffled(nn.Module):
    """Registered ``head`` first but run last: registration order is not backward order."""

    def __init__(self, width: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.head = nn.Linear(width, 1)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _first(index: ParamIndex) -> str:
    vector = full_pass(index)
    summary = summarize_host(vector, vector.norms.tolist(), index)
    return index.names[summary.first_position]


def _backward(model: nn.Module, width: int = 4) -> None:
    model(torch.randn(2, width)).sum().backward()


def test_measured_order_names_the_module_nearest_the_loss():
    model = Shuffled()
    index = ParamIndex(model)
    index.order.watch(index.params)
    _backward(model)
    index.order.settle()
    assert index.order.measured
    order = index.order.names(index.names)
    assert order[0].startswith("head.") and order[-1].startswith("layers.0.")
    assert order.index("layers.2.weight") < order.index("layers.1.weight")
    # A NaN begun at layers.1 reaches layers.0 too; head (registered first) stays finite.
    for name in ("layers.1.weight", "layers.0.weight", "layers.0.bias"):
        index.grad_of(name).view(-1)[0] = float("nan")
    assert _first(index) in ("layers.1.weight", "layers.1.bias")
    index.grad_of("head.bias").view(-1)[0] = float("inf")
    assert _first(index) == "head.bias"  # nearest the loss of all


def test_hooks_are_one_shot_and_later_steps_keep_the_order():
    model = Shuffled()
    index = ParamIndex(model)
    index.order.watch(index.params)
    _backward(model)
    index.order.settle()
    first = list(index.order.rank)
    seen: list[int] = []
    for p in index.params:  # nothing of ddpmon's remains on the parameters
        assert not getattr(p, "_post_accumulate_grad_hooks", None), p
        p.register_post_accumulate_grad_hook(lambda _p, seen=seen: seen.append(1))
    _backward(model)
    index.order.settle()
    assert index.order.rank == first and len(seen) == len(index.params)


def test_no_backward_seen_keeps_reverse_registration_and_the_hooks():
    model = Shuffled()
    index = ParamIndex(model)
    index.order.watch(index.params)
    index.order.settle()  # an inert step: nothing seen, nothing settled
    assert not index.order.measured
    assert index.order.names(index.names)[0] == index.names[-1]
    _backward(model)
    index.order.settle()
    assert index.order.measured and index.order.names(index.names)[0].startswith("head.")
    index.order.close()


def test_together_ranks_a_block_in_reverse_registration():
    """FSDP2 runs one unit's hooks in registration order: ``together`` reverses them."""
    model = Shuffled()
    index = ParamIndex(model)
    index.order.watch(index.params)
    block = [index.names.index(f"layers.2.{k}") for k in ("weight", "bias")]
    index.order.together(block)
    _backward(model)
    index.order.settle()
    order = index.order.names(index.names)
    assert order.index("layers.2.bias") < order.index("layers.2.weight")


def test_numpy_summary_picks_the_same_origin():
    width, layers = 4, 40  # 82 parameters: summarize_host takes its numpy path
    model = Shuffled(width, layers)
    index = ParamIndex(model)
    assert len(index) > 64
    index.order.watch(index.params)
    _backward(model, width)
    index.order.settle()
    for k in range(0, 21):
        index.grad_of(f"layers.{k}.weight").view(-1)[0] = float("nan")
    assert _first(index) == "layers.20.weight"
