"""A short training job for the linger test: one process, published into an sd_dir, trains for
``--seconds``, closes and prints what it exported last (JSON on stdout)."""

import argparse
import json
import time

import torch
from torch import nn

import ddpmon


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-id", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--sd-dir", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--linger", type=float, default=None, help="None: the agent's default")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    options = {"linger_seconds": args.linger} if args.linger is not None else {}
    mon = ddpmon.attach(
        model, opt, port=args.port, bind="127.0.0.1", run_id=args.run_id,
        run_dir=args.run_dir, sd_dir=args.sd_dir, **options,
    )
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
    state = mon.state
    closing = time.monotonic()
    mon.close()
    print(json.dumps({
        "steps_total": state.steps_total,
        "step": state.step,
        "close_seconds": time.monotonic() - closing,
        "lingered": mon.endpoint.lingered,
        "linger_seconds": mon.config.linger_seconds,
    }), flush=True)


if __name__ == "__main__":
    main()
