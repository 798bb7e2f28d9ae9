"""One rank of the pipeline-parallel checks: ``ddpmon.attach(model_parts, opt, schedule=...)``
on torch's schedules, the model split by torchtitan's ``_split_module``, the reference norms from
torchtitan's ``clip_grad_norm_(..., pp_mesh=)`` and from the unsplit model on the same data.
Writes what it saw to --out/rank<R>.json; the assertions live in test_pipeline.py.

Every schedule (GPipe, 1F1B, Interleaved1F1B) for each composition in ``--dp`` (``none``: pp
over the world; ``fsdp2``, ``ddp``: pp x dp on 2 x 2 ranks). ``--nan``: also the four NaN sites
(1F1B, 2 stages, pp only), injected at step 1, micro-batch 1.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torchtitan.distributed.pipeline_parallel import (
    _get_pp_rank_to_stage_indices_mapping,
    _split_module,
)
from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

import ddpmon
from tests.parallel._worker import destroy_process_group_now
from tests.support.ports import free_ports
from tests.support.scrape import scrape_text as scrape

V, D, T, B, NMB = 16, 16, 6, 8, 4
STEPS = 2
LR = 0.1
SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
}
SPLITS = {
    2: [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]],
    4: [["embed", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "head"]],
}
NAN_STEP, NAN_MB = 1, 1
NAN_SITES = {
    # site: (stage whose module is hooked, module inside that stage, what is poisoned)
    "param_grad": (1, "layers.1.fc1", "param"),  # layers.3 of the unsplit model
    "activation_grad_last": (1, "layers.1", "grad"),
    "activation_grad_first": (0, "layers.0", "grad"),
    "activation": (0, "layers.0", "act"),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Tiny(nn.Module):
    """torchtitan's Decoder shape: forward tolerates the parts a split set to None. The layers
    are an ``nn.ModuleList``, which the split renumbers (names collide across stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, V), target.reshape(-1))


def batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(V, (dp_size * B, T), generator=gen)
    y = torch.randint(V, (dp_size * B, T), generator=gen)
    return x[dp_rank * B : (dp_rank + 1) * B], y[dp_rank * B : (dp_rank + 1) * B], x, y


ALL_REDUCES = [0]
"""``dist.all_reduce`` calls in this process (``count_all_reduces`` wraps the real one)."""


def count_all_reduces() -> None:
    """Count every ``dist.all_reduce`` call (the real collective still runs): ddpmon's own
    per-step reductions are the ones issued inside ``schedule.step()`` and ``optimizer.step()``
    under FSDP2 (which reduce-scatters and all-gathers but never all-reduces)."""
    original = dist.all_reduce

    def counted(*args, **kwargs):
        ALL_REDUCES[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted


def metric_lines(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]


class Run:
    """One schedule x composition: split, wrap, attach, train STEPS steps beside the unsplit
    reference model."""

    def __init__(
        self, mesh, schedule_name: str, dp: str, out: str, port: int, **options
    ) -> None:
        self.pp_mesh = mesh["pp"]
        self.dp_mesh = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
        pp_rank, pp_size = self.pp_mesh.get_local_rank(), self.pp_mesh.size()
        self.dp_rank = self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
        self.dp_size = self.dp_mesh.size() if self.dp_mesh is not None else 1
        tag = f"-{options.pop('tag')}" if "tag" in options else ""  # one run dir per run
        n_stages = 4 if schedule_name == "Interleaved1F1B" else 2
        torch.manual_seed(0)
        self.whole = Tiny()
        self.reference = copy.deepcopy(self.whole)
        indices = _get_pp_rank_to_stage_indices_mapping(
            pp_rank, pp_size, schedule_name, n_stages
        )
        self.parts, stages = [], []
        for k in indices:
            part = _split_module(self.whole, SPLITS[n_stages][k])
            if dp == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for layer in part.layers:
                    fully_shard(layer, mesh=self.dp_mesh, reshard_after_forward=False)
                fully_shard(part, mesh=self.dp_mesh, reshard_after_forward=False)
                module = part
            elif dp == "ddp":
                # Without find_unused_parameters, torch 2.13's reducer fails at the second
                # step's bucket rebuild ("rebuilt parameter indices size is not same"), ddpmon
                # attached or not: the schedule's first step runs an extra metadata pass.
                module = nn.parallel.DistributedDataParallel(
                    part, process_group=self.dp_mesh.get_group(), find_unused_parameters=True
                )
            else:
                module = part
            self.parts.append(module)
            group = self.pp_mesh.get_group()
            stages.append(PipelineStage(module, k, n_stages, torch.device("cpu"), group=group))
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        cls = SCHEDULES[schedule_name]
        held = stages if cls is ScheduleInterleaved1F1B else stages[0]
        self.schedule = cls(held, NMB, loss_fn=loss_fn)
        self.params = [p for m in self.parts for p in m.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=LR)
        self.ref_opt = torch.optim.SGD(self.reference.parameters(), lr=LR)
        self.mon = ddpmon.attach(
            self.parts if len(self.parts) > 1 else self.parts[0],
            self.opt,
            schedule=self.schedule,
            port=port,
            bind="127.0.0.1",
            run_dir=os.path.join(out, "runs"),
            run_id=f"pp-{schedule_name}-{dp}{tag}",
            announce=False,
            **options,
        )
        assert self.mon.enabled, self.mon.error

    def step(self, step: int, clip: bool = True) -> dict:
        x, y, gx, gy = batch(step, self.dp_rank, self.dp_size)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        before = ALL_REDUCES[0]
        self.schedule.step(*args, **kwargs)
        all_reduces = ALL_REDUCES[0] - before
        if self.last:
            self.mon.observe_loss(torch.stack(losses).mean())  # scale_grads=True: the mean
        else:
            self.mon.observe_loss(torch.tensor(-1.0))  # torchtitan's stand-in: must be dropped
        before = ALL_REDUCES[0]
        clip = float(ddpmon.clip_grad_norm_(self.params, 1e9)) if clip else None  # collective
        clip_all_reduces = ALL_REDUCES[0] - before
        titan = float(titan_clip(self.params, 1e9, pp_mesh=self.pp_mesh))
        ref_loss = loss_fn(self.reference(gx), gy)
        ref_loss.backward()
        unsplit = math.sqrt(
            sum(float(p.grad.double().pow(2).sum()) for p in self.reference.parameters())
        )
        before = ALL_REDUCES[0]
        self.opt.step()  # ddpmon collects the step here
        all_reduces += ALL_REDUCES[0] - before
        self.opt.zero_grad(set_to_none=True)
        self.ref_opt.step()
        self.ref_opt.zero_grad(set_to_none=True)
        record = self.mon.recent_steps()[-1]
        return {
            "step": record.step,
            "ours": record.grad_norm,
            "titan": titan,
            "clip": clip,
            "unsplit": unsplit,
            "local": record.grad_local_norm,
            "groups": sorted(record.group_norms),
            "loss": record.loss,
            "comm_count": {op: len(v) for op, v in record.collective_seconds.items()},
            "comm_max": {op: max(v) for op, v in record.collective_seconds.items() if v},
            "comm_bytes": dict(record.collective_bytes),
            "duration": record.duration_seconds,
            "ref_loss": float(ref_loss.detach()),
            "all_reduces": all_reduces,
            "clip_all_reduces": clip_all_reduces,
        }


def run_norms(args, dp: str) -> dict:
    if dp == "none":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    results = {}
    for i, name in enumerate(SCHEDULES):
        port = free_ports(1) - int(os.environ["LOCAL_RANK"]) if i == 0 else 0
        run = Run(mesh, name, dp, args.out, port)
        steps = [run.step(s) for s in range(STEPS)]
        stages = getattr(run.schedule, "_stages", None) or [run.schedule._stage]
        recv_hooks = sum(  # tensor hooks on the persistent receive buffers (must stay none)
            len(getattr(info.buffer, "_backward_hooks", None) or {})
            for stage in stages
            for infos in stage.args_recv_info.values()
            for info in infos
            if getattr(info, "buffer", None) is not None
        )
        run.mon.flush()  # the replica check of the first step has been compared
        entry = {
            "recv_hooks": recv_hooks,
            "recv_buffers": sum(len(s.args_recv_info) for s in stages if not s.is_first),
            "steps": steps,
            "strategy": run.mon.state.strategy,
            "steps_total": run.mon.state.steps_total,
            "last": run.last,
            "names": list(run.mon.index.names),
            "errors": dict(run.mon.state.agent_errors),
            "clip_reused": getattr(run.mon.source.inner, "clip_norms_reused", None),
            "replicas_over": (run.mon.flow.replicas.scope.over
                              if run.mon.flow.replicas is not None else None),
            "replica_mismatches": run.mon.state.replica_mismatch_total,
        }
        if port:
            text = scrape(run.mon.port)
            entry["loss_lines"] = metric_lines(text, "ddpmon_loss")
            entry["info"] = metric_lines(text, "ddpmon_rank_info")
        run.mon.close()
        entry["restored"] = "step" not in vars(run.schedule)
        results[name] = entry
    return results


def _inject(run: Run, site: str) -> None:
    """Poison micro-batch NAN_MB of step NAN_STEP at ``site`` (counted per step: the metadata
    pass of step 0 is a forward without a micro-batch id)."""
    stage_index, module_name, what = NAN_SITES[site]
    modules = {s.stage_index: s.submod for s in run.schedule._stages} if hasattr(
        run.schedule, "_stages"
    ) else {run.schedule._stage.stage_index: run.schedule._stage.submod}
    if stage_index not in modules:
        return
    module = modules[stage_index].get_submodule(module_name)
    calls = {"n": 0}
    run.calls = calls

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t * float("nan")

    if what == "param":
        def grad_hook(g: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return poisoned(g) if calls["n"] == NAN_MB + 1 and calls.get("armed") else g

        module.weight.register_hook(grad_hook)
        return

    def forward_hook(mod, inputs, output):
        calls["n"] += 1
        if not (calls.get("armed") and calls["n"] == NAN_MB + 1):
            return None
        if what == "act":
            return poisoned(output)
        output.register_hook(poisoned)
        return None

    module.register_forward_hook(forward_hook)


def run_nan(args, dp: str, sites) -> dict:
    """``sites`` injected one per run, 1F1B; under dp only on dp rank 0 (one replica)."""
    if dp == "none":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    results = {}
    for i, key in enumerate(sites):
        site, _, policy = key.partition("+")
        port = free_ports(1) - int(os.environ["LOCAL_RANK"]) if i == 0 and dp == "none" else 0
        options = {"on_nonfinite": policy} if policy else {}
        options["tag"] = key.replace("+", "-")
        run = Run(mesh, "1F1B", dp, args.out, port, **options)
        if run.dp_rank == 0:
            _inject(run, site)
        for s in range(NAN_STEP + 2):
            calls = getattr(run, "calls", None)
            if calls is not None:
                calls["n"] = 0
                calls["armed"] = s == NAN_STEP
            run.step(s)
        records = [r.as_dict() for r in run.mon.recent_steps()]
        results[key] = {
            "records": [
                {k: r[k] for k in ("step", "origin", "poisoned", "local_nonfinite",
                                   "local_nonfinite_param", "pp_origin", "grad_norm",
                                   "skipped_by")}
                for r in records
            ],
            "origin_total": run.mon.state.grad_nonfinite_origin_steps_total,
            "errors": dict(run.mon.state.agent_errors),
        }
        events = run.mon.ctx.run_dir.events(dist.get_rank())
        run.mon.close()
        results[key]["events"] = [
            e for e in map(json.loads, Path(events).read_text().splitlines())
            if e.get("kind") == "nonfinite" and e.get("origin")
        ]
    return results


def run_data_check(args, dp: str) -> dict:
    """pp x dp, 1F1B, the duplicate-data check on every step: two steps where both dp ranks of
    a stage get the same batch (``dp_rank`` 0's slice), then two with their own slices."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    run = Run(mesh, "1F1B", dp, args.out, 0, data_check_interval=1, tag="datacheck")
    own = run.dp_rank
    for s in range(4):
        run.dp_rank = 0 if s < 2 else own  # steps 0-1: a duplicated shard
        run.step(s, clip=False)
    run.dp_rank = own
    records = [r.as_dict() for r in run.mon.recent_steps()]
    out = {"identical": [r["data_identical_ranks"] for r in records],
           "errors": dict(run.mon.state.agent_errors)}
    run.mon.close()
    out["manifest"] = json.loads(Path(run.mon.ctx.run_path, "manifest.json").read_text()) \
        if dist.get_rank() == 0 else None
    return out


FAIL_STEP, FAIL_RANK = 1, 1


def run_fail(args, dp: str) -> dict:
    """pp x dp, 1F1B: rank FAIL_RANK's measurement of the reduced norms raises at FAIL_STEP
    (injected into the measurement's pass of ``dtensor_norms``). It must still take part in
    the one reduction, and every rank then reports no norm for that step (never NaN), before
    and after it the right one. ``ddpmon.clip_grad_norm_`` runs on every step: at the failed
    one every rank must leave the step's reduction alike (the failure flag, read on the host)
    and compute the norm again, or their collectives would not match. The last step does not
    clip, so its folded all-reduce is left to the record thread (on_nonfinite='record')."""
    from ddpmon.strategies import dtensor_norms

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    run = Run(mesh, "1F1B", dp, args.out, 0, tag="fail")
    real = dtensor_norms.raw_local  # the measurement's look at the shards (not the clip's)

    def broken(grad):
        raise RuntimeError("injected: the norm pass failed")

    deferred: list[bool] = []  # per step: queued with the folded all-reduce still in flight
    push = run.mon.flow.readback.push

    def queued(values, meta, later=None):
        deferred.append(later is not None)
        return push(values, meta, later)

    run.mon.flow.readback.push = queued
    steps = []
    for s in range(FAIL_STEP + 2):
        if s == FAIL_STEP and dist.get_rank() == FAIL_RANK:
            dtensor_norms.raw_local = broken
        try:  # the last step does not clip: nothing on the training thread waits for the sum
            steps.append(run.step(s, clip=s <= FAIL_STEP))
        finally:
            dtensor_norms.raw_local = real
    result = {"steps": steps, "errors": dict(run.mon.state.agent_errors), "deferred": deferred}
    run.mon.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--nan", action="store_true", help="also the four NaN sites")
    parser.add_argument(
        "--nan-dp", default="", help="also an activation-gradient NaN on the last stage, pp x dp"
    )
    parser.add_argument("--dp", default="none", help="comma-separated: none, fsdp2, ddp")
    parser.add_argument("--fail-dp", default="", help="also a failed measurement on one rank")
    parser.add_argument("--strategy", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count_all_reduces()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    result: dict = {"rank": rank, "norms": {dp: run_norms(args, dp) for dp in args.dp.split(",")}}
    if args.nan:
        result["nan"] = run_nan(args, "none", [*NAN_SITES, "param_grad+skip"])
    if args.nan_dp:
        result["nan_dp"] = run_nan(args, args.nan_dp, ["activation_grad_last"])
    if args.fail_dp:
        result["fail_dp"] = run_fail(args, args.fail_dp)
    result["data_check"] = {dp: run_data_check(args, dp) for dp in args.dp.split(",")
                            if dp != "none"}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    destroy_process_group_now()


if __name__ == "__main__":
    main()
