"""Issue #48, straggler attribution under every strategy: on 4 real gloo ranks, one launch runs
each case in turn (its own model, monitor and run), and the rank given 15 % more of its own work
per step is named first with cause ``compute`` within 40 steps:

- FSDP2 (one shard group of 4): the slow rank waits least in its reduce-scatters and
  all-gathers;
- HSDP (2 replicas x 2 shards) and TP (4-way; every rank the same batch);
- DeepSpeed ZeRO-1 (the engine's forward, backward and step);
- pipeline parallel (2 stages x 2 replicas, 1F1B): the slow rank is named with its ``stage``,
  compared with its stage's other replica, and the bubble of stage 0 (which waits for stage 1
  every step) names nobody there; by the timeline, by ``ddpmon top``'s column and by the
  shipped rules and alert (the run's exported totals through ``promtool``);
- DDP where one rank's gradient bucket waits 4 ms in its comm hook before the all-reduce (a slow
  path to the network): named first with cause ``communication``, by the timeline and by
  ``ddpmon top``'s column.

Nothing asserts this machine's speed: only which rank is named, why, and (where the split is
exported) that the slow rank's own work is the run's largest at the same time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ddpmon import metrics
from ddpmon.commands._top_stragglers import straggler_scores
from ddpmon.export.scrape import flatten
from ddpmon.forensics.stragglers import describe
from ddpmon.forensics.timeline import build_timeline
from ddpmon.mixin import render
from ddpmon.mixin.config import MixinConfig
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).with_name("straggler_strategies_worker.py")
WORLD = 4
STEPS = 40
CASES = {"fsdp2": 1, "hsdp": 2, "tp": 3, "deepspeed": 0, "pp": 3, "ddp-comm": 2}
"""strategy -> the slow rank (pp: rank 3 holds stage 1, beside rank 2)."""


def _launch(out: Path, strategies: list[str]) -> tuple[Path, list[dict]]:
    args: list[str] = []
    for strategy in strategies:
        args += ["--case", f"{strategy}:{strategy}:{STEPS}:{CASES[strategy]}"]
    return out, run_ranks(WORKER, out, args, world=WORLD, timeout=420,
                          env={"DS_ACCELERATOR": "cpu"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every case but DeepSpeed's, in one launch."""
    out = tmp_path_factory.mktemp("stragglers-strategies")
    return _launch(out, [s for s in CASES if s != "deepspeed"])


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """DeepSpeed's case alone (its import and C++ ops load apart from the other cases)."""
    return _launch(tmp_path_factory.mktemp("stragglers-deepspeed"), ["deepspeed"])


def _run_dir(out: Path, case: str) -> Path:
    return out / "runs" / f"straggler-{case}"


@pytest.mark.parametrize("strategy", ["fsdp2", "hsdp", "tp", "deepspeed"])
def test_a_rank_with_15_percent_more_work_is_named_first_with_cause_compute(strategy, request):
    out, results = request.getfixturevalue("deepspeed_run" if strategy == "deepspeed" else "runs")
    named = build_timeline(_run_dir(out, strategy)).stragglers
    assert named, f"{strategy}: no straggler named"
    first = named[0]
    assert (first["rank"], first["cause"]) == (CASES[strategy], "compute"), named
    assert first["since_step"] < STEPS and first["excess_seconds"]["compute"] > 0
    assert "stage" not in first
    assert all(r[strategy]["parts"]["compute"] > 0 for r in results)


def test_a_slow_pipeline_stage_is_named_as_a_stage_against_its_replica(runs):
    out, results = runs
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", "timeline",
                           str(_run_dir(out, "pp")), "--json", "--no-slurm"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    named = json.loads(proc.stdout)["stragglers"]
    assert named, "pp: no straggler named"
    first = named[0]
    assert (first["rank"], first["stage"], first["cause"]) == (3, "1", "compute"), named
    assert first["since_step"] < STEPS
    # stage 0 waits for stage 1 every step (its bubble): never its own time, so neither of
    # its ranks is named
    assert all(s["rank"] == 3 for s in named), named
    assert describe(first).startswith("stage 1 (rank 3) was ")
    # the schedule's forward and backward are compute (the step's one call), not host time
    assert all(r["pp"]["parts"]["compute"] > 0 for r in results)


def test_a_rank_whose_collectives_wait_in_its_comm_hook_is_named_with_cause_communication(runs):
    out, results = runs
    named = build_timeline(_run_dir(out, "ddp-comm")).stragglers
    assert named, "ddp-comm: no straggler named"
    first = named[0]
    assert (first["rank"], first["cause"]) == (2, "communication"), named
    assert first["excess_seconds"]["communication"] > 0
    # the others wait for it in the all-reduce as they would for a slow computer: what grew
    # is its own issue time, exported as the part "communication"
    comm = [r["ddp-comm"]["parts"]["communication"] for r in results]
    assert max(range(WORLD), key=comm.__getitem__) == 2, comm
    scraped = {str(r): flatten((out / f"ddp-comm.rank{r}.metrics").read_text())
               for r in range(WORLD)}
    scores = straggler_scores(scraped, {})
    slowest = max(scores, key=lambda t: scores[t]["slowdown"])
    assert (slowest, scores[slowest]["cause"]) == ("2", "communication"), scores


_TOTALS = (metrics.STEP_DURATION.sample("sum"), metrics.STEP_DURATION.sample("count"),
           metrics.DATA_WAIT.sample("sum"), metrics.DATA_WAIT.sample("count"),
           metrics.STEP_PART_SECONDS.name, metrics.STEP.name)


def _as_promtool_series(out: Path, case: str, minutes: int = 10) -> list[dict]:
    """Each rank's exported totals (step, data wait, parts with their labels) as promtool input
    series growing evenly from 0 to them over ``minutes``: the rules' rates then see the run's
    mean per step, as a scraper would over a steady run."""
    series = []
    for r in range(WORLD):
        text = (out / f"{case}.rank{r}.metrics").read_text()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name not in _TOTALS:
                    continue
                labels = {k: v for k, v in s.labels.items() if v} | {
                    "job": "ddpmon", "instance": f"h:{7470 + r}"}
                body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                series.append({"series": f"{s.name}{{{body}}}",
                               "values": f"0+{s.value / (2 * minutes):.9g}x{2 * minutes}"})
    return series


def test_the_rules_and_top_name_the_slow_pipeline_stage_and_not_the_bubble(runs, tmp_path):
    """The shipped rules over the pipeline run's real totals: rank 3 alone is a straggler, of
    stage 1, cause compute; so is ``ddpmon top``'s column; stage 0's ranks (the bubble) and
    rank 2 (stage 1 heavier than stage 0 by design) are named by neither."""
    out, _ = runs
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed with the test dependencies (make debs)"
    named = ("count by (rank, stage, cause) (rank:ddpmon_straggler:cause and on (job, instance)"
             " rank:ddpmon_straggler:slowdown > 0.05)")
    case = {
        "interval": "30s", "input_series": _as_promtool_series(out, "pp"),
        "promql_expr_test": [
            {"expr": named, "eval_time": "10m",
             "exp_samples": [{"labels": '{rank="3",stage="1",cause="compute"}', "value": 1}]},
            {"expr": 'count by (rank, stage, cause) (ALERTS{alertname="DdpmonStraggler",'
                     'alertstate="firing"})', "eval_time": "10m",
             "exp_samples": [{"labels": '{rank="3",stage="1",cause="compute"}', "value": 1}]},
        ],
    }
    # The shipped rules but for the alert's floor: a straggler must also be 2 ms a step above
    # its reference (straggler_min_seconds; held by promtool case r3 in communication.yml).
    # Rank 3's own work is about 20 ms a step on this Xeon, so its 15 % more lands near the
    # floor: 1.84 ms above the other rank of its stage in a full suite on quiet cores (which
    # failed), more under load, less on a faster CPU. Without the floor the test holds on any
    # CPU; what it checks is the grouping by stage.
    rules = sorted(render.write(tmp_path / "rules", MixinConfig().replace(
        straggler_min_seconds=0.0)), key=lambda f: f.name != render.RULES_FILE)  # rules first
    groups = [g["name"] for f in rules for g in yaml.safe_load(f.read_text())["groups"]]
    test = tmp_path / "pp.yml"
    test.write_text(yaml.safe_dump({
        "rule_files": [str(f) for f in rules],
        "evaluation_interval": "15s", "group_eval_order": groups, "tests": [case]}))
    proc = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scraped = {str(r): flatten((out / f"pp.rank{r}.metrics").read_text()) for r in range(WORLD)}
    scores = straggler_scores(scraped, {})
    assert [scores[t].get("stage") for t in "0123"] == ["0", "0", "1", "1"], scores
    assert {t for t, s in scores.items() if s["cause"]} == {"3"}, scores
    assert scores["3"]["cause"] == "compute", scores
