"""Step-time overhead of the agent, measured side by side in one 2-rank gloo DDP job.

Modes (each with its own identical DDP replica in the same job, interleaved so that drift and
noise hit every mode alike):
  base     unmonitored DDP
  agent    ddpmon.attach(...) (comm hook, fused norms, lazy readback, HTTP endpoint)
  scrape   the agent's replica while an external process scrapes its /metrics at 10 Hz
  naive    a tensor hook per parameter doing isnan/isinf/norm/.item() (the blog-post sanitizer)
  pyhook   DDP with torch's own Python ``allreduce_hook`` and nothing else: the cost of having
           any Python comm hook (DDP then no longer fuses the 1/world_size division into its
           bucket copy)
  floor    ``pyhook`` plus one fused norm pass (``_foreach_norm``) over each bucket's reduced
           gradients: the least any agent that reports per-parameter norms must do; agent/floor
           is what ddpmon adds on top of that

Reports medians and quartiles of per-round ratios: agent/base and naive/base from steps
interleaved one by one; agent+scrape/agent from alternating blocks.
Usage: python benchmarks/overhead.py [--rounds N] [--scrape-pairs N] [--write benchmarks/RESULTS.md]
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

MODES = ("base", "agent", "naive", "pyhook", "floor")
SCRAPER = (
    "import http.client,sys,time\n"
    "new=lambda: http.client.HTTPConnection('127.0.0.1',int(sys.argv[1]),timeout=2)\n"
    "conn=new()\n"
    "while True:\n"
    "    t=time.monotonic()\n"
    "    try:\n"
    "        conn.request('GET','/metrics'); conn.getresponse().read()\n"
    "    except Exception:\n"
    "        conn.close(); conn=new()\n"
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


def floor_hook(state, bucket):
    """torch's allreduce_hook plus one fused norm pass over the reduced bucket."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sizes = [p.numel() for p in bucket.parameters()]

    def done(fut):
        tensor = fut.value()[0] if isinstance(fut.value(), list) else fut.value()
        torch.stack(torch._foreach_norm(list(tensor.split(sizes))))
        return tensor

    return allreduce_hook(state, bucket).then(done)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpmon

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    replicas = {}
    for mode in MODES:
        model = build_model(args.d_model, args.layers)
        if mode == "naive":
            naive_hooks(model)
        ddp = DistributedDataParallel(model)
        if mode in ("pyhook", "floor"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, allreduce_hook if mode == "pyhook" else floor_hook)
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
    # Phase 1: base / agent / naive interleaved step by step in a shuffled order per round, so
    # drift and noise hit every mode alike; one ratio per round.
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        order = list(MODES)
        schedule_rng.shuffle(order)
        rounds.append({mode: step(mode) for mode in order})
    # Phase 2: the agent's replica with and without an external 10 Hz scraper, in alternating
    # blocks (the scraper is a separate, niced process holding one keep-alive connection, like
    # Prometheus; niced so that on a 2-core box its own CPU use does not count as ours).
    pairs: list[dict[str, float]] = []
    for i in range(args.scrape_pairs):
        pair = {}
        for mode in ("agent", "scrape") if i % 2 == 0 else ("scrape", "agent"):
            scraper = None
            if mode == "scrape":
                scraper = subprocess.Popen(
                    [sys.executable, "-c", SCRAPER, str(mon.port)], preexec_fn=lambda: os.nice(19)
                )
                time.sleep(0.3)
            step("agent")  # one unmeasured step after switching
            pair[mode] = statistics.median(step("agent") for _ in range(args.block))
            if scraper is not None:
                scraper.kill()
                scraper.wait()
        pairs.append(pair)
    renders = mon.exposition.renders if mon.exposition else 0
    mon.close()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"rounds": rounds, "pairs": pairs, "params": params, "renders": renders})
        )
    dist.barrier()
    dist.destroy_process_group()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def summarize(data: dict, args: argparse.Namespace) -> str:
    rounds, pairs = data["rounds"], data["pairs"]
    rows = []
    for mode, ref_name, source in (
        ("agent", "base", rounds),
        ("naive", "base", rounds),
        ("pyhook", "base", rounds),
        ("floor", "base", rounds),
        ("agent", "floor", rounds),
        ("scrape", "agent", pairs),
    ):
        ratios = [r[mode] / r[ref_name] for r in source]
        q1, med, q3 = quartiles(ratios)
        label = "agent + 10 Hz scrape / agent" if mode == "scrape" else f"{mode} / {ref_name}"
        rows.append(f"| {label} | {med:.3f}x | {q1:.3f}x | {q3:.3f}x | {len(ratios)} |")
    q1, med, q3 = quartiles([r["base"] for r in rounds])
    cmd = (
        f"python benchmarks/overhead.py --rounds {args.rounds} --scrape-pairs "
        f"{args.scrape_pairs} --block {args.block} --d-model {args.d_model} --layers "
        f"{args.layers} --batch {args.batch} --seq {args.seq} --threads {args.threads}"
    )
    return "\n".join(
        [
            "## Agent overhead (2-rank gloo DDP on CPU)",
            "",
            f"Command: `{cmd}` (`make bench`)  ",
            f"Model: transformer, {data['params'] / 1e6:.1f}M parameters, AdamW, batch "
            f"{args.batch} x {args.seq} tokens, {args.threads} thread(s) per rank, 2 ranks on "
            f"{os.cpu_count()} cores. Each mode has its own identical DDP replica in the same "
            f"job. base/agent/naive/pyhook/floor: {args.rounds} rounds, one step of each mode per "
            f"round in a shuffled order, one ratio per round. Scrape: {args.scrape_pairs} "
            f"alternating blocks of {args.block} steps with and without a niced keep-alive "
            f"scraper at 10 Hz.  ",
            f"Unmonitored step time: median {med * 1000:.0f} ms (quartiles {q1 * 1000:.0f}-"
            f"{q3 * 1000:.0f} ms). Exposition renders during the run: {data['renders']}.",
            "",
            "| ratio | median | Q1 | Q3 | n |",
            "|---|---|---|---|---|",
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
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--scrape-pairs", type=int, default=12)
    p.add_argument("--block", type=int, default=4)
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
            "--scrape-pairs",
            str(args.scrape_pairs),
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
