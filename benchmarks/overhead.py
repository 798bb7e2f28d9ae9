"""Step-time overhead of the agent, measured side by side in one 2-rank gloo DDP job.

Modes (each with its own identical DDP replica, interleaved in shuffled blocks so drift and noise
hit every mode alike):
  base     unmonitored DDP
  agent    ddpmon.attach(...) (comm hook, fused norms, lazy readback, HTTP endpoint)
  scrape   the agent's replica while an external process scrapes its /metrics at 10 Hz
  naive    a tensor hook per parameter doing isnan/isinf/norm/.item() (the blog-post sanitizer)

Reports medians and quartiles of per-block ratios mode/base (scrape is also given vs agent).
Usage: python benchmarks/overhead.py [--rounds N] [--block K] [--write benchmarks/RESULTS.md]
(rank processes are launched by this script; --worker is internal).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("base", "agent", "scrape", "naive")
SCRAPER = (
    "import sys,time,urllib.request\n"
    "url=sys.argv[1]\n"
    "while True:\n"
    "    t=time.monotonic()\n"
    "    try: urllib.request.urlopen(url,timeout=1).read()\n"
    "    except Exception: pass\n"
    "    time.sleep(max(0.0,0.1-(time.monotonic()-t)))\n"
)


def build_model(d_model: int, layers: int):
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1024, d_model)
            layer = nn.TransformerEncoderLayer(
                d_model, 8, 4 * d_model, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, 1024)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)))

    torch.manual_seed(0)
    return LM()


def naive_hooks(model) -> None:
    import torch

    def check(grad):
        if torch.isnan(grad).any().item() or torch.isinf(grad).any().item():
            print("non-finite gradient", file=sys.stderr)
        grad.norm().item()
        return grad

    for p in model.parameters():
        p.register_hook(check)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpmon

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    replicas = {}
    for mode in ("base", "agent", "naive"):
        model = build_model(args.d_model, args.layers)
        if mode == "naive":
            naive_hooks(model)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        replicas[mode] = (ddp, opt)
    mon = ddpmon.attach(
        *replicas["agent"], port=args.port, bind="127.0.0.1", run_dir=args.run_dir, run_id="bench"
    )
    replicas["scrape"] = replicas["agent"]
    params = sum(p.numel() for p in replicas["base"][0].parameters())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
    y = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(mode: str) -> float:
        ddp, opt = replicas[mode]
        t0 = time.perf_counter()
        loss = loss_fn(ddp(x).reshape(-1, 1024), y.reshape(-1))
        if mode in ("agent", "scrape"):
            mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    schedule_rng = random.Random(1234)  # same schedule on every rank: collectives must match
    for mode in MODES:
        step(mode)  # warm-up each replica (allocations, DDP bucket rebuild)
    blocks: list[dict] = []
    for _ in range(args.rounds):
        order = list(MODES)
        schedule_rng.shuffle(order)
        for mode in order:
            scraper = None
            if mode == "scrape":
                scraper = subprocess.Popen(
                    [sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{mon.port}/metrics"]
                )
                time.sleep(0.3)
            step(mode)  # one unmeasured step after switching replicas
            times = [step(mode) for _ in range(args.block)]
            if scraper is not None:
                scraper.kill()
                scraper.wait()
            blocks.append({"mode": mode, "median": statistics.median(times)})
    renders = mon.exposition.renders if mon.exposition else 0
    mon.close()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"blocks": blocks, "params": params, "renders": renders})
        )
    dist.barrier()
    dist.destroy_process_group()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def summarize(data: dict, args: argparse.Namespace) -> str:
    by_round: dict[str, list[float]] = {m: [] for m in MODES}
    for block in data["blocks"]:
        by_round[block["mode"]].append(block["median"])
    base = by_round["base"]
    rows = []
    for mode, ref_name in (
        ("agent", "base"),
        ("naive", "base"),
        ("scrape", "base"),
        ("scrape", "agent"),
    ):
        ref = by_round[ref_name]
        ratios = [m / r for m, r in zip(by_round[mode], ref, strict=True)]
        q1, med, q3 = quartiles(ratios)
        rows.append(f"| {mode} / {ref_name} | {med:.3f}x | {q1:.3f}x | {q3:.3f}x |")
    q1, med, q3 = quartiles(base)
    cmd = (
        f"python benchmarks/overhead.py --rounds {args.rounds} --block {args.block} "
        f"--d-model {args.d_model} --layers {args.layers} --batch {args.batch} "
        f"--seq {args.seq} --threads {args.threads}"
    )
    return "\n".join(
        [
            "## Agent overhead (2-rank gloo DDP on CPU)",
            "",
            f"Command: `{cmd}`  ",
            f"Model: transformer, {data['params'] / 1e6:.1f}M parameters, AdamW, batch "
            f"{args.batch} x {args.seq} tokens, {args.threads} thread(s) per rank, 2 ranks on "
            f"{os.cpu_count()} cores. {args.rounds} rounds x 4 modes, shuffled each round; each "
            f"block is the median of {args.block} steps; ratios are per round, then summarised.  ",
            f"Unmonitored step time: median {med * 1000:.0f} ms (quartiles {q1 * 1000:.0f}-"
            f"{q3 * 1000:.0f} ms). Exposition renders during the run: {data['renders']}.",
            "",
            "| ratio | median | Q1 | Q3 |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


def write_section(path: Path, section: str) -> None:
    header = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if header in text:
        start = text.index(header)
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[nxt + 1 :] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", default=None, help="append/replace the section in this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            __file__,
            "--worker",
            "--out",
            str(out),
            "--port",
            str(free_port()),
            "--run-dir",
            tmp,
            "--rounds",
            str(args.rounds),
            "--block",
            str(args.block),
            "--d-model",
            str(args.d_model),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--threads",
            str(args.threads),
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        subprocess.run(cmd, check=True, env=env)
        section = summarize(json.loads(out.read_text()), args)
    print(section)
    if args.write:
        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
