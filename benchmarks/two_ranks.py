"""What the 2-rank overhead benchmarks share: their command line, the launch of the two gloo
workers (each runs the benchmark's own ``--worker`` mode and rank 0 writes one JSON result) and
the residual MLP they time. One place, so that the FSDP2, DeepSpeed and pipeline rows are
measured the same way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from overhead import free_port

WORKER_ARGS = ("rounds", "block", "d_model", "layers", "batch", "threads")
"""The options a worker receives from the launcher, as given on its command line."""


def bench_parser(description: str, timeout: float = 600) -> argparse.ArgumentParser:
    """The options every 2-rank overhead benchmark takes (model size, rounds, threads, where
    to write its section), plus the hidden ones its workers get."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--block", type=int, default=4,
        help="steps of each mode per round, back to back (FSDP2 and pipeline benchmarks): a "
        "round's ratio is of block sums, so one descheduled step moves it less",
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--write", default=None, help="append/replace the section in this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    return parser


def launch(script: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    """Run ``script --worker`` as ranks 0 and 1 of a gloo job on 127.0.0.1 and return the JSON
    result rank 0 wrote; a rank that fails or outlives ``args.timeout`` ends the benchmark."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        master, base_port = free_port(), free_port()
        procs = []
        for rank in range(2):
            rank_env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                OMP_NUM_THREADS=str(args.threads), **(env or {}),
            )
            cmd = [
                sys.executable, script, "--worker", "--out", str(out), "--port", str(base_port),
                *[
                    f"--{k.replace('_', '-')}={v}"
                    for k, v in vars(args).items()
                    if k in WORKER_ARGS
                ],
            ]
            procs.append(subprocess.Popen(cmd, env=rank_env, start_new_session=True))
        try:
            for proc in procs:
                proc.wait(timeout=args.timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if any(proc.returncode for proc in procs):
            raise SystemExit("a rank failed")
        return json.loads(out.read_text())


def bench_main(
    script: str,
    worker: Callable[[argparse.Namespace], None],
    summarize: Callable[[dict, argparse.Namespace], str],
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> None:
    """A benchmark's ``main``: as a worker, run ``worker``; otherwise launch the two ranks,
    print the section ``summarize`` makes of rank 0's result (the load average before and after
    in ``data["load"]``) and write it with ``--write``."""
    from overhead import write_section

    doc = (sys.modules["__main__"].__doc__ or script).splitlines()[0]
    args = bench_parser(doc, timeout=timeout).parse_args()
    if args.worker:
        worker(args)
        return
    load_start = os.getloadavg()
    data = launch(script, args, env=env)
    data["load"] = [round(load_start[0], 1), round(os.getloadavg()[0], 1)]
    section = summarize(data, args)
    print(section)
    if args.write:
        write_section(Path(args.write), section)


def residual_blocks(d_model: int, layers: int) -> list:
    """``layers`` pre-norm residual MLP blocks (4x hidden), seeded: the model the FSDP2,
    DeepSpeed and pipeline benchmarks time (the pipeline one splits the list into stages)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d_model)
            self.w_in = nn.Linear(d_model, 4 * d_model)
            self.w_out = nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            return x + self.w_out(torch.relu(self.w_in(self.norm(x))))

    torch.manual_seed(0)
    return [Block() for _ in range(layers)]


def residual_net(d_model: int, layers: int):
    """The blocks and a linear head as one module with ``blocks`` and ``head`` children."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(residual_blocks(d_model, layers))
            self.head = nn.Linear(d_model, d_model)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net()
