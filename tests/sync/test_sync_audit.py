"""The sync audit (docs/sync-audit.md): for every strategy, the monitored loop makes no op that
would stall the host on a GPU beyond what the same loop makes unmonitored.

Each launch runs its strategies' loops on real gloo ranks with ``DDPMON_SYNC_AUDIT=1`` (ddpmon
takes its accelerator branches on the CPU), once unmonitored and once with ``ddpmon.attach`` and
every per-step feature on (tests/sync/_audit_worker.py), under ``SyncAudit``
(tests/support/sync_audit.py). The failure mode is tested too: a ``.item()`` injected into a
hot-path function must be reported, with the ddpmon frame it came from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks
from tests.support.sync_audit import added_ops
from tests.sync._audit_worker import STEPS

# A launch runs in the first test that needs it: DeepSpeed's (imports, three engines, two runs
# each) took 20-130 s alone on 2 cores and up to 300 s beside other suites' ranks.
pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).with_name("_audit_worker.py")
ENV = {"DDPMON_SYNC_AUDIT": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}

LAUNCHES: dict[str, tuple[int, tuple[str, ...]]] = {
    # launch -> (world size, runs); "+scaler": the loop steps through a GradScaler
    "two": (2, ("plain", "plain+scaler", "ddp", "ddp+scaler", "fsdp2", "fsdp2+scaler", "tp",
                "tp+scaler", "pp", "ddp+flops", "fsdp2+scaler+flops", "pp+flops")),
    "four": (4, ("hsdp", "hsdp+scaler", "fsdp2+tp", "fsdp2+tp+scaler")),
    "deepspeed": (2, ("zero1", "zero2", "zero3")),
}
RUNS = [(launch, run) for launch, (_, runs) in LAUNCHES.items() for run in runs]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    done: dict[str, list[dict]] = {}

    def get(launch: str) -> list[dict]:
        if launch not in done:
            world, runs = LAUNCHES[launch]
            out = tmp_path_factory.mktemp(launch)
            done[launch] = run_ranks(WORKER, out, ["--runs", ",".join(runs)], world=world,
                                     env=ENV, timeout=400)
        return done[launch]

    return get


@pytest.mark.parametrize(("launch", "run"), RUNS, ids=[r for _, r in RUNS])
def test_monitored_loop_adds_no_host_sync(launched, launch, run):
    for rank in launched(launch):
        result = rank["runs"][run]
        monitored, unmonitored = result["monitored"], result["unmonitored"]
        added = added_ops(monitored["training"], unmonitored["training"])
        assert added == {}, (rank["rank"], added, monitored["where"])
        assert monitored["steps"] == STEPS, monitored
        assert not any(monitored["agent_errors"].values()), monitored["agent_errors"]
        # TP's block-output checks run on the audited steps too (strategies/block_entry.py)
        assert monitored["entry_blocks"] == (5 if "tp" in run.split("+") else 0), monitored
        # the update figures (update_every=1) were measured on every step, every strategy
        # (DeepSpeed: its ZeRO partitions; pp: each stage's groups)
        assert monitored["update_sampled"] == STEPS, monitored
        # "+flops": FLOPs counted automatically on an audited step (flops.auto), not given
        counted = run.endswith("+flops")
        assert monitored["flops"]["counted"] is counted, monitored["flops"]
        if counted:
            assert monitored["flops"]["per_step"] > 0, monitored["flops"]
        # not vacuous: the recorder saw the loop's own host reads (the optimizer's step
        # counters, a GradScaler's found_inf) in both runs alike
        assert unmonitored["training"], unmonitored
        assert monitored["training"] == unmonitored["training"], (monitored, unmonitored)


def test_an_injected_item_on_the_hot_path_is_reported(tmp_path):
    """The audit's failure mode: ``per_param_norms`` (every strategy's norm pass) made to call
    ``.item()`` is reported as added ``_local_scalar_dense`` ops, named by its ddpmon frame."""
    ranks = run_ranks(WORKER, tmp_path, ["--runs", "ddp,fsdp2",
                                         "--inject-item", "ddpmon.probes.grads:per_param_norms"],
                      world=2, env=ENV, timeout=300)
    for rank in ranks:
        for run in ("ddp", "fsdp2"):
            result = rank["runs"][run]
            added = added_ops(result["monitored"]["training"], result["unmonitored"]["training"])
            assert added.get("aten._local_scalar_dense", 0) >= STEPS - 1, (run, added)
            where = result["monitored"]["where"]["aten._local_scalar_dense"]
            assert all(place.startswith("_audit_worker.py") and "with_item < ddpmon/" in place
                       for place in where), where


def test_an_injected_item_in_the_automatic_flop_count_is_reported(tmp_path):
    """The automatic FLOP count's per-step code made to call ``.item()``: the input signature
    read at each step's first forward (``flops.auto.signature``: every audited step) and the
    token count read inside the counted step, under FlopCounterMode (``leading_count``): each
    reported, named by its ddpmon frame."""
    targets = "ddpmon.flops.auto:signature,ddpmon.flops.auto:leading_count"
    ranks = run_ranks(WORKER, tmp_path, ["--runs", "ddp+flops", "--inject-item", targets],
                      world=2, env=ENV, timeout=300)
    for rank in ranks:
        result = rank["runs"]["ddp+flops"]
        assert result["monitored"]["flops"]["counted"], result["monitored"]
        added = added_ops(result["monitored"]["training"], result["unmonitored"]["training"])
        assert added.get("aten._local_scalar_dense", 0) >= STEPS, added  # 4 steps + 1 count
        where = result["monitored"]["where"]["aten._local_scalar_dense"]
        assert all("with_item < ddpmon/flops/auto.py" in place for place in where), where
        assert any("auto.py" in place and "_start" in place for place in where), where
