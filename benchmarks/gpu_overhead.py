"""The agent's step-time overhead on one GPU, on the largest model that fits it.

The model (a stack of ``nn.TransformerEncoderLayer``, bf16 autocast, fused AdamW) is sized from
the device's free memory: about 16 bytes a parameter (fp32 weights, gradients, two Adam moments)
in ``--memory-fraction`` of it, the rest for activations, capped at ``--max-params`` so that the
run fits ``make gpu-check``'s 8 minutes (>= 1B parameters on an 80 GB card). One model, measured
A-B-A in one process: unmonitored steps, then ``ddpmon.attach`` and monitored steps, then
``close`` and unmonitored steps again; the ratio is the monitored median over the median of both
unmonitored blocks, so drift (clocks, temperature) hits both sides. Each step ends with a
``torch.cuda.synchronize()`` of the benchmark's own, to time it; the agent adds none.

Usage: python benchmarks/gpu_overhead.py [--steps N] [--json OUT] (``--device cpu --max-params
2e6`` runs the same code on a tiny model, for the test of scripts/gpu_check.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

BYTES_PER_PARAM = 16
D_MODEL = 2048
SEQ = 512


def layer_params(d_model: int) -> int:
    """Parameters of one encoder layer (4 d^2 attention, 2 * 4 d^2 feed-forward, biases, norms)."""
    return 12 * d_model * d_model + 13 * d_model


def plan(free_bytes: int, fraction: float, max_params: float, d_model: int) -> int:
    """How many layers fit ``fraction`` of ``free_bytes`` (at least one)."""
    budget = min(free_bytes * fraction / BYTES_PER_PARAM, max_params)
    return max(1, int(budget // layer_params(d_model)))


def build(layers: int, d_model: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, d_model // 128 or 1, 4 * d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return model.to(device)


def run_block(model, opt, x, steps: int, mon=None) -> list[float]:
    """Seconds per step, each step synchronised by the benchmark (not the agent)."""
    device = x.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        with autocast:
            loss = model(x).float().pow(2).mean()
        if mon is not None:
            mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def measure(device: torch.device, steps: int, fraction: float, max_params: float,
            d_model: int = D_MODEL, batch: int = 4, seq: int = SEQ) -> dict:
    import ddpmon

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = int(max_params * BYTES_PER_PARAM / fraction), 0
    layers = plan(free, fraction, max_params, d_model)
    model = build(layers, d_model, device)
    params = sum(p.numel() for p in model.parameters())
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused, foreach=not fused)
    x = torch.randn(batch, seq, d_model, device=device)
    run_block(model, opt, x, 2)  # warm-up: allocator, kernels, optimizer state
    base_before = run_block(model, opt, x, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpmon.attach(model, opt, port=0, run_dir=run_dir, announce=False)
        run_block(model, opt, x, 2, mon)  # the agent's first steps build its plans
        agent = run_block(model, opt, x, steps, mon)
        errors = sum(mon.state.agent_errors.values())
        mon.close()
    base_after = run_block(model, opt, x, steps)
    base = statistics.median(base_before + base_after)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": params,
        "layers": layers,
        "d_model": d_model,
        "tokens_per_step": batch * seq,
        "free_bytes_before": free,
        "total_bytes": total,
        "peak_allocated_bytes": peak,
        "base_step_seconds_median": base,
        "agent_step_seconds_median": statistics.median(agent),
        "agent_over_base": statistics.median(agent) / base,
        "base_drift": statistics.median(base_after) / statistics.median(base_before),
        "agent_errors": errors,
        "steps_per_block": steps,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--max-params", type=float, default=2.0e9)
    p.add_argument("--d-model", type=int, default=D_MODEL)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_overhead: needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    figures = measure(device, args.steps, args.memory_fraction, args.max_params, args.d_model)
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
