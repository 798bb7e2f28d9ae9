"""Cost of ``on_nonfinite='rerun'`` on CPU, measured side by side in one process.

Two copies of the residual MLP, each with its own agent: one under ``record``, one under
``rerun``, both stepping with ``optimizer.step(closure)``. Each round times one step of each,
alternating which goes first. A step that does not trigger pays the RNG state's copy and the one
host read of three numbers (the read ``skip`` and ``raise`` make too); the ratio of the medians
is that cost. Then ``--triggers`` steps with a one-off NaN in one gradient are timed against the
clean steps around them: a triggered step runs forward and backward twice and is skipped.

Usage: python benchmarks/rerun_cost.py [--rounds N] [--triggers N] [--d-model D] [--layers L]
[--batch B] [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--triggers", type=int, default=20)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--write", default=None)
    args = p.parse_args()
    import torch
    from two_ranks import residual_net

    import ddpmon

    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.d_model)
    load_before = os.getloadavg()[0]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("record", "rerun"):
            torch.manual_seed(0)
            model = residual_net(args.d_model, args.layers)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            mon = ddpmon.attach(model, opt, port=0, run_dir=tmp, run_id=mode, on_nonfinite=mode)
            runs[mode] = (model, opt, mon)

        def step(mode: str, poison: bool = False) -> float:
            model, opt, _ = runs[mode]
            armed = [poison]

            def closure():
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if armed[0]:  # the first backward only: transient
                    armed[0] = False
                    loss = loss * float("nan")
                loss.backward()
                return loss

            start = time.perf_counter()
            opt.step(closure)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"record": [], "rerun": []}
        for r in range(args.rounds + 5):
            order = ("record", "rerun") if r % 2 else ("rerun", "record")
            for mode in order:
                took = step(mode)
                if r >= 5:
                    times[mode].append(took)
        triggered, around = [], []
        for _ in range(args.triggers):
            around.append(step("rerun"))
            triggered.append(step("rerun", poison=True))
        reruns = dict(runs["rerun"][2].state.step_reruns_total)
        for _, _, mon in runs.values():
            mon.close()
    assert reruns == {"deterministic": 0, "transient": args.triggers}, reruns
    record, rerun = statistics.median(times["record"]), statistics.median(times["rerun"])
    trig, clean = statistics.median(triggered), statistics.median(around)
    params = sum(q.numel() for q in runs["record"][0].parameters())
    cmd = (f"python benchmarks/rerun_cost.py --rounds {args.rounds} --triggers {args.triggers} "
           f"--d-model {args.d_model} --layers {args.layers} --batch {args.batch}")
    section = "\n".join([
        "## Step reruns (on_nonfinite='rerun', CPU, world size 1)",
        "",
        f"Command: `{cmd}`  ",
        f"Model: {args.layers} residual MLP blocks (d={args.d_model}), {params / 1e6:.1f}M "
        f"parameters, AdamW, batch {args.batch}, 1 thread, {os.cpu_count()} cores; "
        f"{args.rounds} rounds, one closure step under `record` and one under `rerun` each "
        f"(order alternating). Load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after.  ",
        f"A step that does not trigger: median {record * 1000:.2f} ms under `record`, "
        f"{rerun * 1000:.2f} ms under `rerun`: **{rerun / record:.3f}x** (the RNG copy and "
        "the one host read).  ",
        f"A triggered step (a one-off NaN, rerun, skipped), {args.triggers} of them: median "
        f"{trig * 1000:.2f} ms against {clean * 1000:.2f} ms for the clean steps beside them: "
        f"**{trig / clean:.2f}x** (forward and backward twice).",
        "",
    ])
    print(section)
    if args.write:
        from overhead import write_section

        write_section(Path(args.write), section)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
