"""One rank of the sync audit: each strategy's training loop runs twice under ``SyncAudit``,
unmonitored and then monitored with every per-step feature on, and the rank writes both runs'
counts of host-syncing ops (tests/support/sync_audit.py) to ``OUT/rank<R>.json``.

Run as ``python _audit_worker.py --out DIR --runs ddp,ddp+scaler,...`` with the rank env of
tests/support/ranks.py and ``DDPMON_SYNC_AUDIT=1`` (ddpmon then takes its accelerator branches
on the CPU). ``--device cuda`` runs the loops on the GPU (one rank: ``make gpu-check``), where
torch's own CUDA sync debug mode (``warn``) is on during every step and its warnings are counted
too, as ``cuda-sync-debug``. ``--inject-item MODULE:FUNCTION[,...]`` wraps ddpmon functions so
that each calls ``.item()`` on its first tensor argument: the audit must report it (tests/sync).
A run named ``STRATEGY+flops`` counts its FLOPs automatically (``flops_count_step``, which runs
where the figures are served: an endpoint on a free port) on an audited step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ddpmon  # noqa: E402
from ddpmon import host_reads  # noqa: E402
from tests.support.ports import free_ports  # noqa: E402
from tests.support.sync_audit import SyncAudit  # noqa: E402

STEPS = 5
"""Steps per run; the audit window is steps 1..STEPS-1 (step 0 builds plans and caches)."""
D = 16
FEATURES = {
    "port": 0,
    "data_check_interval": 1,
    "replica_check_every": 1,
    "local_norm_every": 1,
    "step_metrics": ("learning_rate",),
    "update_every": 1,
    "announce": False,
    # MFU inputs: the rates are computed at scrape time from host values, never per step
    "peak_flops": 1e12,
    "flops_per_step": 1e6,
    "tokens_per_step": 32.0,
}
"""Every per-step feature, at its most frequent: each runs on every audited step."""
FLOPS_COUNT_STEP = 2
"""``+flops`` runs: the automatic count's step (entered at its first forward, left at the next
step's), inside the audit window."""


def features(flops: bool) -> dict:
    """``FEATURES``; with ``flops``, FLOPs counted automatically instead of given. The count
    runs only where the throughput figures are served (``agent/throughput_live.py``): the rank
    serves /metrics on a free port (``port + LOCAL_RANK``)."""
    if not flops:
        return dict(FEATURES)
    out = {k: v for k, v in FEATURES.items() if k != "flops_per_step"}
    out.update(port=free_ports(1) - int(os.environ.get("LOCAL_RANK", "0")), bind="127.0.0.1",
               flops_count_step=FLOPS_COUNT_STEP)
    return out
DEVICE = torch.device("cpu")
"""Where the loops run (``--device``)."""
SYNC_DEBUG = "cuda-sync-debug"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, 2 * D), nn.ReLU(),
                         nn.Linear(2 * D, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, D, generator=gen), torch.randint(4, (8,), generator=gen)
    return x.to(DEVICE), y.to(DEVICE)


class Loop:
    """One strategy's model and loop, written as a training script writes it."""

    flops = False
    """Count FLOPs automatically (a ``+flops`` run)."""

    def __init__(self, strategy: str, scaler: bool) -> None:
        self.strategy = strategy
        self.model = self.build(strategy)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, foreach=True)
        self.scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8) if scaler else None
        self.mon = None

    @staticmethod
    def build(strategy: str) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = mlp().to(DEVICE)
        world, kind = dist.get_world_size(), DEVICE.type
        # every linear layer parallel (one optimizer over DTensors only, as a TP script has)
        tp_plan = {"0": ColwiseParallel(), "2": RowwiseParallel(),
                   "4": ColwiseParallel(output_layouts=Replicate())}
        if strategy == "plain":
            return model
        if strategy == "ddp":
            ids = [DEVICE.index or 0] if kind == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if strategy == "fsdp2":
            mesh = init_device_mesh(kind, (world,))
            fully_shard(model[2], mesh=mesh)
            return fully_shard(model, mesh=mesh)
        if strategy == "hsdp":
            mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("replicate", "shard"))
            fully_shard(model[2], mesh=mesh)
            return fully_shard(model, mesh=mesh)
        if strategy == "tp":
            mesh = init_device_mesh(kind, (world,), mesh_dim_names=("tp",))
            return parallelize_module(model, mesh, tp_plan)
        if strategy == "fsdp2+tp":
            mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], tp_plan)
            return fully_shard(model, mesh=mesh["dp"])
        raise SystemExit(f"unknown strategy {strategy}")

    def attach(self) -> None:
        head = "module.4" if self.strategy == "ddp" else "4"  # its max logit, read in forward
        self.mon = ddpmon.attach(self.model, self.opt, self.scaler, run_dir=RUN_DIR,
                                 run_id=f"audit-{self.strategy}-{self.scaler is not None}",
                                 logit_modules=(head,), **features(self.flops))
        assert self.mon.enabled, self.mon.error

    def step(self, step: int) -> None:
        x, y = batch(step, dist.get_rank() if self.strategy in ("ddp", "fsdp2", "hsdp") else 0)
        loss = F.cross_entropy(self.model(x), y)
        if self.mon is not None:
            self.mon.observe_loss(loss)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.mon is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            total = ddpmon.clip_grad_norm_(self.params, 1.0)
            self.mon.observe_grad_norm(total)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class PipelineLoop(Loop):
    """Two stages of one MLP, GPipe with two micro-batches (torch.distributed.pipelining)."""

    def __init__(self, strategy: str, scaler: bool) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.strategy = strategy
        rank = dist.get_rank()
        whole = mlp().to(DEVICE)
        self.model = whole[:3] if rank == 0 else whole[3:]
        self.stage = PipelineStage(self.model, rank, 2, DEVICE)
        self.schedule = ScheduleGPipe(self.stage, 2, loss_fn=F.cross_entropy)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, foreach=True)
        self.scaler = None
        self.mon = None

    def attach(self) -> None:
        self.mon = ddpmon.attach(self.model, self.opt, schedule=self.schedule, run_dir=RUN_DIR,
                                 run_id="audit-pp", **features(self.flops))
        assert self.mon.enabled, self.mon.error

    def step(self, step: int) -> None:
        x, y = batch(step, 0)
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=losses)
        if self.mon is not None:
            if losses:
                self.mon.observe_loss(torch.stack(losses).mean())
            self.mon.observe_grad_norm(ddpmon.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class DeepSpeedLoop(Loop):
    """``deepspeed.initialize`` with ZeRO stage N (fp32, CPU accelerator, gloo)."""

    def __init__(self, strategy: str, scaler: bool) -> None:
        import deepspeed

        self.strategy = strategy
        config = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": int(strategy[-1]), "reduce_bucket_size": 1200},
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
        }
        model = mlp()
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        self.scaler = None
        self.mon = None

    def attach(self) -> None:
        self.mon = ddpmon.attach(self.engine, run_dir=RUN_DIR, run_id=f"audit-{self.strategy}",
                                 **FEATURES)
        assert self.mon.enabled, self.mon.error

    def step(self, step: int) -> None:
        x, y = batch(step, dist.get_rank())
        loss = F.cross_entropy(self.engine(x), y)
        if self.mon is not None:
            self.mon.observe_loss(loss)
        self.engine.backward(loss)
        self.engine.step()


def make_loop(run: str) -> Loop:
    flops = run.endswith("+flops")
    run = run.removesuffix("+flops")
    scaler = run.endswith("+scaler")
    strategy = run.removesuffix("+scaler")
    if strategy == "pp":
        loop: Loop = PipelineLoop(strategy, scaler)
    elif strategy.startswith("zero"):
        loop = DeepSpeedLoop(strategy, scaler)
    else:
        loop = Loop(strategy, scaler)
    loop.flops = flops
    return loop


def audited(run: str, monitored: bool) -> dict:
    loop = make_loop(run)
    if monitored:
        loop.attach()
    with SyncAudit() as audit:
        for step in range(STEPS):
            # the loop's own phase (mon.phase) and a scrape's read of the rank's activity
            # (agent.activity, a scrape thread's work) are per-step code too: audited here
            marked = loop.mon.phase("audit") if loop.mon is not None else nullcontext()
            with cuda_sync_debug() as caught, marked:
                loop.step(step)
                if loop.mon is not None:
                    loop.mon.activity.samples()
            if audit.recording and caught:
                audit.training[SYNC_DEBUG] += len(caught)
            audit.recording = step < STEPS - 1  # on after the first step, off after the last
    if loop.mon is not None:
        errors = dict(loop.mon.state.agent_errors)
        steps = loop.mon.state.steps_total
        entry = getattr(loop.mon.markers, "entry", None)  # TP: where a NaN entered, per block
        entry_blocks = len(entry.names) if entry is not None else 0
        auto = getattr(loop.mon, "flops_auto", None)  # the automatic count (+flops runs)
        flops = {"per_step": loop.mon.flops_per_step,
                 "counted": auto is not None and auto.counted_seconds is not None}
        loop.mon.flush()
        sampled = sum(1 for r in loop.mon.recent_steps() if r.update_stats)  # update_every=1
        loop.mon.close()
    else:
        errors, steps, entry_blocks, sampled, flops = {}, STEPS, 0, 0, {}
    out = audit.report()
    out.update(agent_errors=errors, steps=steps, entry_blocks=entry_blocks,
               update_sampled=sampled, flops=flops)
    dist.barrier()
    return out


class cuda_sync_debug:
    """torch's CUDA sync debug mode at ``warn`` for one step, its warnings collected (CUDA only;
    elsewhere an empty list)."""

    def __enter__(self) -> list:
        self.caught: list = []
        if DEVICE.type != "cuda":
            return self.caught
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self.caught

    def __exit__(self, *exc: object) -> None:
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            kept = [w for w in self.caught if "synchroniz" in str(w.message)]
            self._catch.__exit__(*exc)
            self.caught[:] = kept


def inject_item(target: str) -> None:
    """Wrap ``module:function`` so that it reads its first tensor argument with ``.item()``."""
    module_name, _, attr = target.partition(":")
    owner_name, _, func_name = attr.rpartition(".")
    module = importlib.import_module(module_name)
    owner = getattr(module, owner_name) if owner_name else module
    original: Callable = getattr(owner, func_name)

    def with_item(*args, **kwargs):
        for a in [*args, *kwargs.values()]:
            tensors = a if isinstance(a, (list, tuple)) else [a]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.numel():
                    t.reshape(-1)[0].item()  # the injected host read
                    return original(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, func_name, with_item)
    # modules that imported the function by name keep their own reference: patch those too
    for name, mod in list(__import__("sys").modules.items()):
        if name.startswith("ddpmon") and getattr(mod, func_name, None) is original:
            setattr(mod, func_name, with_item)


RUN_DIR = tempfile.mkdtemp(prefix="ddpmon-audit-")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--inject-item", default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    # the zygote imported ddpmon before this rank's environment existed: read it now
    if not host_reads.reread_env() and args.device == "cpu":
        sys.exit("run with DDPMON_SYNC_AUDIT=1: on the CPU the audit must see the GPU's branches")
    global DEVICE
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    for target in filter(None, (args.inject_item or "").split(",")):
        inject_item(target)
    results = {}
    for run in args.runs.split(","):
        t0 = time.monotonic()
        results[run] = {"unmonitored": audited(run, False), "monitored": audited(run, True)}
        print(f"audit: {run} {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    rank = dist.get_rank()
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "runs": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
