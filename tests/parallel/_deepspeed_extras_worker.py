"""One rank of the DeepSpeed extras, in one gloo process group (DeepSpeed is imported once):

- the loss-scale floor (``on_loss_scale_floor``): a GradScaler under DDP and DeepSpeed's own fp16
  loss scaler in a real ZeRO-2 engine. Rank 1's local gradient gets an inf from ``INF_FROM`` on,
  so every step overflows and both scalers halve their (shared) scale each step;
- the Lightning callback's way to the engine under ``DeepSpeedStrategy`` (which Lightning runs on
  CUDA only): a real engine behind a stand-in trainer with the strategy's attributes.

The rank writes what happened; the tests assert. Run as: ``python _deepspeed_extras_worker.py
--out DIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set (tests/support/ranks.py). ``DS_ACCELERATOR=cpu`` is set here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddpmon  # noqa: E402

STEPS = 10
INF_FROM = 2
INF_RANK = 1
INIT_SCALE = 16.0  # GradScaler: 16 -> 8 at step 2, 4, 2, 1, 0.5 ...
FLOOR = 2.0
K = 2  # GradScaler: after step 4 the scale is 2 (1st), after step 5 it is 1 (2nd): raise at 5
CKPT_STEP = 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def inf_hook(rank: int, step: dict):
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if rank == INF_RANK and step["n"] >= INF_FROM:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        return None

    return hook


def checkpoint(mon, model, out: Path, name: str, rank: int, step: int) -> str:
    path = out / f"{name}-ckpt-{step}.rank{rank}.pt"
    with mon.observe_checkpoint(step + 1, path):
        torch.save(model.state_dict(), path)
    return str(path)


def gradscaler(name: str, mode: str, out: Path, rank: int, fail: bool = False) -> dict:
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=10**6)
    step = {"n": 0}
    model.module.enc.weight.register_hook(inf_hook(rank, step))
    mon = ddpmon.attach(
        model, opt, scaler, port=0, run_dir=str(out / "runs"), run_id=name,
        loss_scale_floor=FLOOR, loss_scale_floor_steps=K, on_loss_scale_floor=mode,
    )
    if fail and rank == INF_RANK:  # test-only: this rank's own facts fail at the decision

        def failing():
            raise RuntimeError("injected failure")

        mon.floor._origins = failing
    gen = torch.Generator().manual_seed(10 + rank)
    result: dict = {"scales": [], "raised": None}
    for n in range(STEPS):
        step["n"] = n
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        loss = (model(x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        opt.zero_grad()
        try:
            scaler.update()
        except ddpmon.LossScaleFloorError as exc:
            result["raised"] = raised(exc, n)
            break
        finally:
            result["scales"].append(scaler.get_scale())
        if n == CKPT_STEP:
            result["ckpt"] = checkpoint(mon, model, out, name, rank, n)
    result["steps_done"] = len(result["scales"])
    result["run_path"] = str(mon.run_path)
    result["errors"] = {k: v for k, v in mon.state.agent_errors.items() if v}
    mon.close()
    return result


def raised(exc: BaseException, at: int) -> dict:
    return {
        "type": type(exc).__name__, "message": str(exc), "at": at, "step": exc.step,
        "loss_scale": exc.loss_scale, "origin_ranks": exc.origin_ranks,
        "checkpoint": exc.checkpoint,
        "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
        "cause_message": str(exc.__cause__) if exc.__cause__ else None,
    }


def ds_config(min_scale: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1,
                 "min_loss_scale": min_scale, "loss_scale_window": 1000},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }


def deepspeed_run(name: str, mode: str, floor: float, out: Path, rank: int) -> dict:
    """DeepSpeed's own DynamicLossScaler in a real fp16 ZeRO-2 engine (min_loss_scale 1)."""
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(1)
    )
    step = {"n": 0}
    engine.module.enc.weight.register_hook(inf_hook(rank, step))
    mon = ddpmon.attach(
        engine, port=0, run_dir=str(out / "runs"), run_id=name,
        loss_scale_floor=floor, loss_scale_floor_steps=K, on_loss_scale_floor=mode,
    )
    gen = torch.Generator().manual_seed(10 + rank)
    result: dict = {"scales": [], "raised": None, "scaler": type(engine.optimizer.loss_scaler)
                    .__name__}
    for n in range(STEPS):
        step["n"] = n
        x, y = torch.randn(4, 8, generator=gen).half(), torch.randn(4, 4, generator=gen).half()
        loss = (engine(x) - y).float().pow(2).mean()
        engine.backward(loss)
        try:
            engine.step()
        except ddpmon.LossScaleFloorError as exc:
            result["raised"] = raised(exc, n)
            break
        except Exception as exc:  # DeepSpeed's own, under record
            result["raised"] = {"type": type(exc).__name__, "message": str(exc), "at": n}
            break
        finally:
            result["scales"].append(engine.optimizer.cur_scale)
        if n == CKPT_STEP:
            result["ckpt"] = checkpoint(mon, engine.module, out, name, rank, n)
    result["steps_done"] = len(result["scales"])
    result["global_steps"] = engine.global_steps
    result["skipped_steps"] = engine.skipped_steps
    result["run_path"] = str(mon.run_path)
    mon.close()
    engine.destroy()
    return result


def lightning_callback(out: Path, rank: int) -> dict:
    """``DdpmonCallback.on_fit_start`` as Lightning's DeepSpeedStrategy presents it: the bare
    LightningModule, ``trainer.optimizers == [engine.optimizer]``, the engine at
    ``strategy.deepspeed_engine`` (and ``strategy.model``)."""
    from types import SimpleNamespace

    from ddpmon.integrations.lightning import DdpmonCallback

    torch.manual_seed(0)
    model = Net()
    config = ds_config(1)
    del config["fp16"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    strategy = SimpleNamespace(deepspeed_engine=engine, model=engine, checkpoint_io=None)
    trainer = SimpleNamespace(
        optimizers=[engine.optimizer], strategy=strategy, precision_plugin=SimpleNamespace(),
        accumulate_grad_batches=1, global_step=0,
    )
    cb = DdpmonCallback(port=0, run_dir=str(out / "runs"), run_id="lightning-ds")
    cb.on_fit_start(trainer, engine.module)
    cb.on_train_start(trainer, engine.module)
    gen = torch.Generator().manual_seed(10 + rank)
    norms = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    mon = cb.monitor
    mon.flush()
    result = {
        "attached": mon.enabled, "monitor_error": mon.error, "strategy": mon.state.strategy,
        "steps": mon.state.steps_total, "global_steps": engine.global_steps,
        "ours": [r.grad_norm for r in mon.recent_steps()], "theirs": norms,
    }
    cb.teardown(trainer, engine.module, "fit")
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # see _deepspeed_worker.fp16_on_cpu
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    runs = {
        "gs-raise": lambda: gradscaler("gs-raise", "raise", args.out, rank),
        "gs-record": lambda: gradscaler("gs-record", "record", args.out, rank),
        "gs-raise-fail": lambda: gradscaler("gs-raise-fail", "raise", args.out, rank, fail=True),
        # ddpmon's rule (floor 2) acts before DeepSpeed's own minimum (1)
        "ds-raise": lambda: deepspeed_run("ds-raise", "raise", FLOOR, args.out, rank),
        # floor below DeepSpeed's minimum: DeepSpeed's own exception comes first
        "ds-min-raise": lambda: deepspeed_run("ds-min-raise", "raise", 0.25, args.out, rank),
        # record: ddpmon's rule records at the K-th step, then DeepSpeed's own exception
        "ds-record": lambda: deepspeed_run("ds-record", "record", FLOOR, args.out, rank),
        "lightning": lambda: lightning_callback(args.out, rank),
    }
    results = {}
    for name, run in runs.items():
        started = time.perf_counter()
        try:
            results[name] = run()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.distributed.barrier()
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results, default=str))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
