"""What the automatic FLOP count costs (docs/goodput.md, MFU): the counted step's wall time over
a plain step's (the median of plain steps run side by side), and the forward pre-hook's time on
every other step (a signature of the inputs compared with the last).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/flop_count_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ddpmon.flops.auto import AutoCount, signature
from ddpmon.flops.count import flop_counter


def model_of(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def measure(width: int, layers: int, seq: int, repeats: int = 5) -> tuple[float, float, float]:
    model = model_of(width, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, seq, width)
    for _ in range(3):
        step(model, opt, x)
    plain, counted = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        step(model, opt, x)
        plain.append(time.perf_counter() - t)
        mode = flop_counter()
        t = time.perf_counter()
        with mode:
            step(model, opt, x)
        counted.append(time.perf_counter() - t)
    steps = iter(range(10**9))
    auto = AutoCount(at_step=1, current_step=lambda: next(steps), on_counted=lambda *a: None,
                     on_error=lambda *a: None)
    auto._steps_seen, auto._sig = 10, signature((x,), {})  # counted: the steady state
    calls = 20000
    t = time.perf_counter()
    for _ in range(calls):  # each call a new step's first forward: a signature compared
        auto.forward(model, (x,), {})
    hook_us = (time.perf_counter() - t) / calls * 1e6
    assert auto._mode is None and not auto.off
    return statistics.median(plain), statistics.median(counted), hook_us


def main() -> None:
    torch.set_num_threads(2)
    print("model                         plain step  counted step  ratio  hook per step")
    for width, layers, seq in ((128, 2, 64), (256, 4, 128)):
        plain, counted, hook = measure(width, layers, seq)
        print(f"encoder w{width} x{layers} seq {seq:<4}     {plain * 1e3:7.1f} ms  "
              f"{counted * 1e3:9.1f} ms  {counted / plain:5.2f}  {hook:6.1f} us")


if __name__ == "__main__":
    main()
