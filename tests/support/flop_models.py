"""Three small models for FLOP-counting tests, written the way trainers write them: a dense
transformer block, attention with grouped-query heads (GQA) and a sliding-window mask, and a
mixture of experts with a top-1 router (only the chosen experts run)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, SEQ = 32, 16


class GqaSlidingWindow(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = 4, kv_heads: int = 2, window: int = 4):
        super().__init__()
        self.heads, self.kv_heads, self.window, self.hd = heads, kv_heads, window, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
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
