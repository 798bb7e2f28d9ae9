"""One rank of the DeepSpeed checks: every config (ZeRO stage x precision x accumulation) runs in
this one process group, one after the other, with ``ddpmon.attach(engine)``; the rank writes
DeepSpeed's own numbers next to ddpmon's records. Assertions live in the tests.

Run as: ``python _deepspeed_worker.py --out DIR [--configs a,b]`` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set (tests/support/ranks.py). ``DS_ACCELERATOR=cpu`` is set here.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from torch import nn  # noqa: E402

import ddpmon  # noqa: E402

STEPS = 4
NAN_STEP = 1
NAN_RANK = 1
NAN_PARAM = "mid.weight"
FAIL_STEP = 2
CLIP = 0.05  # below every clean norm here: clipping always changes the gradients
GROUPS = ("enc", "mid", "head")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 5)  # 5 rows over 2 ranks: ZeRO-3 pads the partitions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.enc(x)))))


def configs() -> dict[str, dict]:
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            for gas in (1, 2):
                out[f"z{stage}-{precision}-gas{gas}"] = {
                    "stage": stage, "precision": precision, "gas": gas, "check": True
                }
    for stage in (1, 2, 3):  # bf16 without DeepSpeed's overflow check: ZeRO-1/2 apply the NaN
        out[f"z{stage}-bf16-nocheck"] = {
            "stage": stage, "precision": "bf16", "gas": 1, "check": False
        }
    for stage in (1, 2, 3):  # fp16 past DeepSpeed's CPU sanity check (see FP16_ON_CPU)
        out[f"z{stage}-fp16-gas2"] = {"stage": stage, "precision": "fp16", "gas": 2, "check": True}
    # A feature ddpmon cannot read (DeepCompile's flag forced on a real engine): one warning,
    # steps still counted, no gradient norms.
    out["z2-fp32-deepcompile"] = {
        "stage": 2, "precision": "fp32", "gas": 1, "check": True, "deepcompile": True
    }
    # An optimizer wrapper ddpmon does not read (ZeRO-1 + bf16 + fp32 accumulation picks
    # DeepSpeed's BF16_Optimizer): one warning, local numbers and steps still measured.
    out["z1-bf16-fp32accum"] = {
        "stage": 1, "precision": "bf16", "gas": 1, "check": True, "fp32_accum": True
    }
    # every rank seeded alike: identical batches, checked on every step
    for stage in (0, 2, 3):
        out[f"z{stage}-fp32-dupdata"] = {
            "stage": stage, "precision": "fp32", "gas": 2, "check": True, "dupdata": True
        }
    # rank 1's reading of its partitions fails at FAIL_STEP: no rank may hang in the all-reduce
    out["z2-fp32-probe-fails"] = {
        "stage": 2, "precision": "fp32", "gas": 1, "check": True, "fail": True
    }
    return out


def fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on its CPU accelerator (``Type fp16 is not supported on your
    device``: oneDNN fp16 is missing). The engine, the ZeRO optimizers and their real loss scaler
    run past that check (shared/notes/deepspeed.md §4); the CPU kernels are fp16-capable."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def ds_config(cfg: dict) -> dict:
    conf = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": cfg["gas"],
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": cfg["stage"], "reduce_bucket_size": 1200},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # DeepSpeed's own op counter, the reference for ddpmon's collective counts (it
        # synchronises after every op: fine in a test, never used by ddpmon itself)
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": False},
    }
    if cfg["precision"] == "fp16":
        conf["fp16"] = {
            "enabled": True, "initial_scale_power": 3, "hysteresis": 1, "min_loss_scale": 1,
            "loss_scale_window": 1000,
        }
    if cfg["precision"] == "bf16":
        conf["bf16"] = {"enabled": True}
        if not cfg["check"]:
            conf["bf16"]["check_grad_overflow"] = False
    if cfg.get("fp32_accum"):
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
    return conf


def run_config(name: str, cfg: dict, out: Path, rank: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    nan_at = {"step": None}

    def inject(grad: torch.Tensor) -> torch.Tensor | None:
        # The last micro-batch of NAN_STEP on NAN_RANK only: its local gradient gets a NaN.
        if nan_at["step"] == NAN_STEP and rank == NAN_RANK:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
            return grad
        return None

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(cfg)
    )
    engine.module.mid.weight.register_hook(inject)  # before attach: ddpmon sees its output
    module_attach = ddpmon.attach(
        engine.module, engine.optimizer, port=0, run_dir=str(out / "runs"), run_id=f"dsm-{name}"
    )
    module_attach.close()  # stage 0 fp32 is not refused (plain module, torch optimizer)
    if cfg.get("deepcompile"):
        engine.is_deepcompile_enabled = lambda: True
    mon = ddpmon.attach(
        engine, port=0, run_dir=str(out / "runs"), run_id=f"ds-{name}", stall_seconds=600,
        data_check_interval=1,
    )
    if cfg.get("fail") and rank == 1 and mon.enabled:
        real = mon.source._reduced_pieces  # test-only: make this rank's own reading fail

        def failing():
            if nan_at["step"] == FAIL_STEP:
                raise RuntimeError("injected failure")
            return real()

        mon.source._reduced_pieces = failing
    second = ddpmon.attach(engine, port=0, run_dir=str(out / "runs"), run_id=f"ds2-{name}")
    deepspeed.comm.comms_logger.reset_data()  # count from here, as ddpmon does
    ref_local: dict[int, float] = {}
    names = dict(engine.module.named_parameters())
    sq = {n: 0.0 for n in names}

    def ref_hook(n: str):
        def hook(grad: torch.Tensor) -> None:
            sq[n] += float(grad.detach().double().pow(2).sum())

        return hook

    handles = [p.register_hook(ref_hook(n)) for n, p in names.items()]
    gen = torch.Generator().manual_seed(100 + (0 if cfg.get("dupdata") else rank))
    ds_norms, ref_global, ref_groups, global_steps, skipped, scales = [], [], [], [], [], []
    for step in range(STEPS):
        nan_at["step"] = step
        scale_used = float(getattr(engine.optimizer, "loss_scale", 1.0))
        for micro in range(cfg["gas"]):
            x = torch.randn(4, 16, generator=gen)
            y = torch.randn(4, 5, generator=gen)
            if cfg["precision"] == "bf16":
                x, y = x.bfloat16(), y.bfloat16()
            elif cfg["precision"] == "fp16":
                x, y = x.half(), y.half()
            loss = (engine(x) - y).float().pow(2).mean()
            engine.backward(loss)
            if micro == cfg["gas"] - 1:  # boundary: DeepSpeed's full (gathered) gradients
                full = {n: safe_get_full_grad(p) for n, p in names.items()}
                unscale = float(getattr(engine.optimizer, "loss_scale", 1.0))
                norms = {
                    n: (float(g.double().norm()) / unscale if g is not None else 0.0)
                    for n, g in full.items()
                }
                ref_groups.append(
                    {
                        grp: math.sqrt(sum(v * v for n, v in norms.items() if n.startswith(grp)))
                        for grp in GROUPS
                    }
                )
                ref_global.append(math.sqrt(sum(v * v for v in norms.values())))
            engine.step()
        value = engine.get_global_grad_norm()
        ds_norms.append(None if value is None else float(value))
        global_steps.append(engine.global_steps)
        skipped.append(engine.skipped_steps)
        scales.append(getattr(engine.optimizer, "cur_scale", None))
        ref_local[step] = math.sqrt(sum(sq.values())) / scale_used
        for n in sq:
            sq[n] = 0.0
    for h in handles:
        h.remove()
    mon.flush()
    ds_comm = {
        op: sum(v[0] for v in sizes.values())
        for op, sizes in deepspeed.comm.comms_logger.get_raw_data().items()
    }
    records = [r.as_dict() for r in mon.recent_steps()]
    state = mon.state
    result = {
        "config": cfg,
        "attached": mon.enabled,
        "error": mon.error,
        "second_attach_error": second.error,
        "second_enabled": second.enabled,
        "strategy": state.strategy,
        "optimizer": type(engine.optimizer).__name__,
        "amp_enabled": state.amp_enabled,
        "loss_scale": state.loss_scale,
        "steps_total": state.steps_total,
        "amp_skipped_steps_total": state.amp_skipped_steps_total,
        "steps_skipped_total": dict(state.steps_skipped_total),
        "origin_steps": state.grad_nonfinite_origin_steps_total,
        "poisoned_steps": state.grad_nonfinite_poisoned_steps_total,
        "errors": {k: v for k, v in state.agent_errors.items() if v},
        "records": records,
        "ds_norms": ds_norms,
        "ref_global": ref_global,
        "ref_groups": ref_groups,
        "ref_local": ref_local,
        "global_steps": global_steps,
        "skipped_steps": skipped,
        "ds_scales": scales,
        "module_attach_error": module_attach.error,
        "run_path": str(mon.run_path),
        "ds_comm_counts": ds_comm,
        "collective_counts": {
            op: h.count for op, h in state.collective_duration.items()
        },
        "collective_means": {
            op: h.sum / h.count for op, h in state.collective_duration.items() if h.count
        },
        "collective_bytes": dict(state.collective_bytes_total),
        "step_mean": state.step_duration.sum / max(1, state.step_duration.count),
    }
    result["exposition"] = mon.exposition.render().decode()
    mon.close()
    reattach = ddpmon.attach(engine, port=0, run_dir=str(out / "runs"), run_id=f"ds3-{name}")
    result["reattach_after_close"] = reattach.enabled
    reattach.close()
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="")
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    # attach before deepspeed.initialize (a bare module and a torch optimizer): a warning only
    bare = Net()
    early = ddpmon.attach(bare, torch.optim.SGD(bare.parameters(), lr=0.1), port=0,
                          run_dir=str(args.out / "runs"), run_id="ds-bare")
    early_enabled = early.enabled
    early.close()
    wanted = [c for c in args.configs.split(",") if c]
    results = {}
    started = time.perf_counter()
    for name, cfg in configs().items():
        if wanted and name not in wanted:
            continue
        results[name] = run_config(name, cfg, args.out, rank)
    payload = {
        "rank": rank, "configs": results, "seconds": time.perf_counter() - started,
        "early_enabled": early_enabled,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(payload, default=str))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
