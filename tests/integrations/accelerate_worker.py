"""One rank of a 2-rank Accelerate loop under torchrun (gloo, CPU) with
``ddpmon.attach(model, optimizer, accelerator=accelerator)`` on the prepared objects.

Gradient accumulation over ``--accumulate`` micro-batches; the loop hands ddpmon the norm
``accelerator.clip_grad_norm_`` returns (a tensor, during the step), scaled by ``--factor`` at
``--wrong-step``; rank ``--nan-rank`` gets a NaN in one local gradient at ``--nan-step``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import ddpmon
from tests.support.integrations import agent_options, json_number

NAN_PARAM = "0.weight"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--wrong-step", type=int, default=2)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--nan-step", type=int, default=5)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mixed-precision", default="no")
    p.add_argument("--deepspeed-stage", type=int, default=None)
    p.add_argument("--unwrapped", action="store_true", help="attach(accelerator.unwrap_model)")
    a = p.parse_args()
    out = Path(a.out)
    plugin = None
    if a.deepspeed_stage is not None:
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(
            zero_stage=a.deepspeed_stage, gradient_accumulation_steps=a.accumulate,
            gradient_clipping=1.0,
        )
        plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
        plugin.deepspeed_config["steps_per_print"] = 10**9
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8  # the loader's batch
        plugin.deepspeed_config["train_batch_size"] = 8 * a.accumulate * world
    accelerator = Accelerator(
        gradient_accumulation_steps=a.accumulate, cpu=plugin is None,
        mixed_precision=a.mixed_precision, deepspeed_plugin=plugin,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randn(512, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    step = 0
    rank = int(os.environ.get("RANK", "0"))  # Accelerate's own index reads 0 under CPU DeepSpeed
    if rank == a.nan_rank:
        param = dict(model.named_parameters())[NAN_PARAM]
        param.register_hook(lambda g: g * float("nan") if step == a.nan_step else g)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = model if plugin is not None else None
    target = accelerator.unwrap_model(model) if a.unwrapped else model
    mon = ddpmon.attach(target, optimizer, accelerator=accelerator, **agent_options(a.port, out))
    reported: dict[int, torch.Tensor] = {}
    ours: dict[int, float | None] = {}
    micro = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x).float(), y)
            mon.observe_loss(loss)
            accelerator.backward(loss)  # DeepSpeed: engine.backward, and engine.step at sync
            micro += 1
            if engine is not None and accelerator.sync_gradients:
                norm = engine.get_global_grad_norm()  # DeepSpeed's own, as the Trainer logs it
                reported[step] = torch.as_tensor(float(norm))
                # engine.step already ran inside backward: name the step the norm belongs to
                wrong = a.factor if step == a.wrong_step else 1
                mon.observe_grad_norm(float(norm) * wrong, step=step)
            elif accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), float("inf"))
                reported[step] = norm.detach().clone()
                mon.observe_grad_norm(norm * a.factor if step == a.wrong_step else norm)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            if mon.state is not None and mon.state.step >= 0:
                ours[mon.state.step] = mon.state.grad_norm
            step += 1
            if step == a.steps:
                break
    exposition = mon.exposition.render().decode() if mon.exposition is not None else ""
    mon.close()
    if mon.state is not None and mon.state.step >= 0:
        ours[mon.state.step] = mon.state.grad_norm
    result = {
        "accelerate_process_index": accelerator.process_index,
        "accelerate_num_processes": accelerator.num_processes,
        "rank": rank,
        "global_step": step,
        "micro_batches": micro,
        "attached": mon.enabled,
        "monitor_error": mon.error,
        "monitor_steps": mon.step,
        "observe_grad_norm": hasattr(mon, "observe_grad_norm"),
        "scaler": type(accelerator.scaler).__name__,
        "distributed_type": str(accelerator.distributed_type),
        "strategy": mon.state.strategy if mon.enabled else None,
        "engine_global_steps": engine.global_steps if engine is not None else None,
        "true_norms": {k: json_number(v) for k, v in reported.items()},
        "ddpmon_norms": {k: json_number(v) for k, v in ours.items()},
        "exposition": exposition,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
    }
    (out / f"result.rank{rank}.json").write_text(json.dumps(result))
    accelerator.end_training()



if __name__ == "__main__":
    main()
