"""Lightning Fabric loops on 2 CPU ranks (gloo), ddpmon attached with what ``fabric.setup``
returned (``fabric_worker.py``, launched by ``fabric.launch()``): measured as the bare strategy.

Runs: DDP (20 optimizer steps of 2 micro-batches under ``fabric.no_backward_sync``), FSDP2
(``ModelParallelStrategy`` with ``fully_shard``; Lightning's ``FSDPStrategy`` is FSDP1 and
GPU-only), DDP with every rank reading the same batches, DDP attached before ``fabric.setup``
(a mistake ddpmon must name), and DDP with a NaN in rank 1's input at step 10, once with
``clip_gradients(error_if_nonfinite=False)`` (the step completes) and once with
``error_if_nonfinite=True`` (``clip_gradients`` raises on both ranks: its test needs the
in-flight step record of branch i45-inflight too). The four DDP runs that complete share one
launch, one after another (``fabric_worker.py ... --then ...``): a Lightning process start is
about 6 CPU-s of imports per rank.
"""

from __future__ import annotations

import json
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.support.history import history_column
from tests.support.integrations import (
    RUN_ID,
    WorkerRun,
    by_step,
    check_nan_origin,
    close,
    python,
    run_worker,
)
from tests.support.ports import free_port_pair

# Found, not imported: only the ranks import Lightning (4 CPU-s), not each xdist worker collecting.
pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="needs lightning")

WORKER = Path(__file__).with_name("fabric_worker.py")
NAN_STEP, NAN_RANK = 10, 1
# A NaN in the input makes every gradient NaN: the origin is the first in backward order, the
# output layer's (its weight and bias become ready in one autograd node).
NAN_PARAM = frozenset({"2.weight", "2.bias"})
PARAM_BYTES = (16 * 64 + 64 + 64 * 4 + 4) * 4
"""The worker's model in fp32: what one all-reduce of all its gradients carries."""
RUNS = {
    "ddp": ["--strategy", "ddp", "--steps", "20"],
    "fsdp2": ["--strategy", "fsdp2", "--steps", "8"],
    "same-data": ["--strategy", "ddp", "--steps", "12", "--same-data"],
    "before-setup": ["--strategy", "ddp", "--steps", "2", "--attach-before-setup"],
    # the NaN step completes (the clip scales by a NaN norm): the last step of the run
    "nan": ["--strategy", "ddp", "--steps", str(NAN_STEP + 1), "--nan-step", str(NAN_STEP)],
    "nan-raises": ["--strategy", "ddp", "--steps", "20", "--nan-step", str(NAN_STEP),
                   "--error-if-nonfinite"],
}


def fabric_launch(names: list[str], base: Path) -> dict[str, WorkerRun]:
    """One Fabric launch (one process start per rank) that trains each named run in turn, each
    with its own model, monitor, port and out dir (``base/<name>``); they share the launch's
    exit code and output."""
    cmd = [python(), str(WORKER)]
    for name in names:
        cmd += ["--then"] if name != names[0] else []
        cmd += ["--out", str(base / name), "--port", str(free_port_pair()),
                "--nan-rank", str(NAN_RANK), *RUNS[name]]
    launch = run_worker(cmd, base, timeout=240)
    return {name: WorkerRun(launch.rc, launch.output, base / name, label=name) for name in names}


def fabric_run(name: str, out: Path) -> WorkerRun:
    return fabric_launch([name], out)[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, WorkerRun]:
    """Two launches: FSDP2, and the four DDP runs one after another in one launch."""
    done = fabric_launch(["fsdp2"], tmp_path_factory.mktemp("fabric-fsdp2"))
    done |= fabric_launch(["ddp", "same-data", "before-setup", "nan"],
                          tmp_path_factory.mktemp("fabric-ddp"))
    for run in done.values():
        assert run.rc == 0, run.output[-4000:]
    return done


def steps_of(args: list[str]) -> int:
    return int(args[args.index("--steps") + 1])


@pytest.mark.parametrize(("name", "strategy"), [("ddp", "ddp"), ("fsdp2", "fsdp2")])
def test_the_strategy_inside_fabrics_wrapper_is_reported(runs, name: str, strategy: str) -> None:
    run = runs[name]
    assert run.manifest()["extra"]["strategy"] == strategy
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["strategy"] == strategy and run.summary(rank)["strategy"] == strategy
        assert res["monitor_steps"] == steps_of(RUNS[name]) == run.summary(rank)["steps"]


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_grad_norm_is_the_pre_clip_norm_clip_gradients_returned(runs, name: str) -> None:
    run = runs[name]
    steps = range(steps_of(RUNS[name]))
    for rank in (0, 1):
        res = run.result(rank)
        theirs, ours = by_step(res["clip_norms"]), by_step(res["grad_norm"])
        assert sorted(theirs) == sorted(ours) == list(steps), (theirs, ours)
        for step in steps:
            assert close(ours[step], theirs[step], 1e-5), (rank, step, ours[step], theirs[step])
        # not vacuous: max_norm=1.0 clipped these steps, so a post-clip value would be 1.0
        assert all(theirs[step] > 1.1 for step in steps), theirs


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_local_norms_are_this_ranks_own_before_the_reduction(runs, name: str) -> None:
    """Measured every ``local_norm_every`` (10) steps: at those steps each rank's own, different
    on each rank and not the reduced norm."""
    history = runs[name].out / "runs" / RUN_ID
    local = [history_column(history, rank, "grad_local_norm") for rank in (0, 1)]
    reduced = history_column(history, 0, "grad_norm")
    measured = [step for step, value in local[0].items() if value is not None]
    assert measured and measured == [s for s, v in local[1].items() if v is not None], local
    assert 0 in measured
    for step in measured:
        assert local[0][step] != local[1][step], (step, local)
        assert not close(local[0][step], reduced[step], 1e-3), (step, local[0], reduced)


def test_all_reduces_are_timed_once_per_optimizer_step(runs) -> None:
    """``fabric.no_backward_sync`` leaves the first micro-batch of each step unreduced: one
    all-reduce of all gradients per optimizer step, timed."""
    steps = steps_of(RUNS["ddp"])
    for rank in (0, 1):
        run = runs["ddp"]
        assert run.summary(rank)["collective_count"] > 0
        assert run.sample(rank, "ddpmon_collective_bytes_total", op="all_reduce") == \
            steps * PARAM_BYTES
        assert run.sample(rank, "ddpmon_collective_duration_seconds_count",
                          op="all_reduce") >= steps


def test_fsdp2_collectives_are_timed(runs) -> None:
    for rank in (0, 1):
        assert runs["fsdp2"].summary(rank)["collective_count"] > 0
        assert (runs["fsdp2"].sample(
            rank, "ddpmon_collective_duration_seconds_count", op="reduce_scatter") or 0) > 0


def test_the_duplicate_data_check_runs(runs) -> None:
    """Every rank reading the same batches is found; distinct shards are not flagged."""
    assert runs["ddp"].manifest()["data_check"]["every"] > 0
    for rank in (0, 1):
        assert runs["same-data"].sample(rank, "ddpmon_data_identical_batches_total") >= 1
        assert runs["ddp"].sample(rank, "ddpmon_data_identical_batches_total") == 0


def test_nan_in_rank1s_input_is_named_with_rank_step_and_tensor(runs) -> None:
    check_nan_origin(runs["nan"], NAN_RANK, NAN_STEP, NAN_PARAM)


def test_attaching_before_fabric_setup_is_not_silent(runs) -> None:
    """The bare module is all ddpmon can see then: each rank says so once, naming it."""
    run = runs["before-setup"]
    warning = "attach got a bare torch.nn.modules.container.Sequential on several ranks"
    assert run.output.count(warning) == 2, run.output[-4000:]
    assert "attach what fabric.setup returned" in run.output
    assert {run.result(rank)["strategy"] for rank in (0, 1)} == {"plain"}


def timeline(run: WorkerRun) -> dict:
    proc = subprocess.run(
        [python(), "-m", "ddpmon.cli", "timeline", str(run.out / "runs" / RUN_ID), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_fabric_clip_error_names_rank1_step10_numerics_and_origin_tensor(
    runs, tmp_path: Path
) -> None:
    """``fabric.clip_gradients`` raises on both ranks at step 10 (the NaN reached every rank
    through the all-reduce): ``ddpmon timeline`` names rank 1 and step 10 first, by evidence,
    as numerics, in the tensor the completed-step run names (the in-flight step's record and
    Fabric's unwrapping together)."""
    run = fabric_run("nan-raises", tmp_path)
    assert run.rc != 0, "clip_gradients(error_if_nonfinite=True) did not raise"
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"] and res["strategy"] == "ddp", res
        assert "non-finite" in res["error"], res["error"]
        assert sorted(by_step(res["clip_norms"])) == list(range(NAN_STEP))
    (control,) = [e["param"] for e in runs["nan"].events(NAN_RANK)
                  if e["kind"] == "nonfinite" and e.get("origin")]
    out = timeline(run)
    first, verdict = out["first_failure"], out["verdict"]
    assert (first["rank"], first["step"]) == (NAN_RANK, NAN_STEP), first
    assert verdict["layer"] == "numerics", verdict
    assert control in json.dumps(first), (control, first)
    assert f"rank {NAN_RANK}, step {NAN_STEP}" in verdict["evidence"], verdict
