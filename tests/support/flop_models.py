"""Three small models for FLOP-counting tests, written the way trainers write them: a dense
transformer block, attention with grouped-query heads (GQA) and a sliding-window mask, and a
mixture of experts with a top-1 router (only the chosen experts run)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ddpmon.flops.count import cpu_attention

DIM, SEQ = 32, 16


class GqaSlidingWindow(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = 4, kv_heads: int = 2, window: int = 4):
        super().__init__()
        self.heads, self.kv_heads, self.window, self.hd = heads, kv_heads, window, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads from the widths: a TP rank holds its share of them
        q = self.q(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.hd).transpose(1, 2)
        i = torch.arange(s)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class TinyMoE(nn.Module):
    def __init__(self, dim: int = DIM, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight, choice = self.router(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.view_as(x)


TP_PLANS = {
    "dense": {"linear1": "colwise", "linear2": "rowwise"},
    "gqa_swa": {"0.q": "colwise", "0.k": "colwise", "0.v": "colwise", "0.o": "rowwise"},
    "moe": {f"1.experts.{e}.{i}": kind for e in range(4)
            for i, kind in ((0, "colwise"), (2, "rowwise"))},
}
"""Tensor-parallel plans (module -> style) the way trainers shard these models: column-parallel
in, row-parallel out; attention heads split across ranks; each expert's MLP split."""


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "dense":
        return nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
    if kind == "gqa_swa":
        return nn.Sequential(GqaSlidingWindow(), nn.Linear(DIM, DIM))
    if kind == "moe":
        return nn.Sequential(nn.Linear(DIM, DIM), TinyMoE())
    raise ValueError(kind)


def batch(step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, SEQ, DIM, generator=g)


def reference_count(model: nn.Module, run: Callable[[nn.Module, torch.optim.Optimizer], object],
                    attention: bool = True) -> int:
    """FlopCounterMode's own count of ``run(copy, SGD)`` on a copy of ``model`` without ddpmon
    (``attention``: with torch's SDPA formulas for the CPU attention kernel, which its registry
    lacks)."""
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    mode = FlopCounterMode(display=False, custom_mapping=cpu_attention() if attention else {})
    with mode:
        run(plain, opt)
    return mode.get_total_flops()
