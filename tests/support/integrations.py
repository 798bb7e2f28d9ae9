"""Helpers for the framework-integration tests: run a multi-process worker and read what it left.

Each worker writes ``result.rank<R>.json`` (the trainer's per-step numbers as it logged them,
ddpmon's per-step numbers as its state showed them, the final exposition) next to ddpmon's own
run directory (events, summaries). Workers run in their own session; on timeout the whole process
group is killed, so no rank outlives its test.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .ranks import run_launcher

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "integration"


@dataclass
class WorkerRun:
    """One finished multi-rank run: exit code, output and the files it left in ``out``."""

    rc: int
    output: str
    out: Path
    label: str = ""
    """What the test ran (e.g. the precision), for its own assertions."""

    def result(self, rank: int) -> dict:
        path = self.out / f"result.rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    def events(self, rank: int) -> list[dict]:
        path = self.out / "runs" / RUN_ID / f"events.rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def manifest(self) -> dict:
        path = self.out / "runs" / RUN_ID / "manifest.json"
        assert path.exists(), f"no manifest; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    def summary(self, rank: int) -> dict:
        path = self.out / "runs" / RUN_ID / f"summary.rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no ddpmon summary; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    def sample(self, rank: int, name: str, **labels: str) -> float | None:
        """Value of a sample in rank's final exposition (its labels include ``labels``)."""
        text = self.result(rank).get("exposition") or ""
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        return None


def run_worker(
    cmd: list[str], out: Path, timeout: float, extra_env: dict | None = None
) -> WorkerRun:
    """Run ``cmd`` (a launcher that starts every rank: ``ranks.torchrun(...)``, Lightning's own)
    through the suite's launcher (``ranks.run_launcher``: own session, hard timeout)."""
    out.mkdir(parents=True, exist_ok=True)
    done = run_launcher(cmd, timeout, extra_env)
    return WorkerRun(done.code, done.stdout + done.stderr, out)


def python() -> str:
    return sys.executable


def close(a: float, b: float, rel: float) -> bool:
    """Relative equality; both non-finite counts as equal (a NaN step on both sides)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def json_number(value) -> float | str | None:
    """A worker's number for its JSON result: a float, its name when not finite ("nan", "inf";
    JSON has no such numbers), or None."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else str(number)


def by_step(mapping: dict) -> dict[int, float]:
    """JSON object keys back to ints; 'nan'/'inf' strings back to floats."""
    return {int(k): float(v) for k, v in mapping.items() if v is not None}


def agent_options(port: int, out: Path) -> dict:
    """ddpmon options for a worker: its own run dir and ports, a tight norm tolerance where the
    agent has the option (1e-5 relative: the equality the tests claim)."""
    from dataclasses import fields

    from ddpmon import Config

    options = {"port": port, "bind": "127.0.0.1", "run_dir": str(out / "runs"), "run_id": RUN_ID}
    if "grad_norm_tolerance" in {f.name for f in fields(Config)}:
        options["grad_norm_tolerance"] = 1e-5
    return options


# ---------------------------------------------------------------------- shared checks
def check_steps(run: WorkerRun, expected: int) -> None:
    """ddpmon counted exactly the trainer's optimizer steps, on every rank."""
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["global_step"] == expected
        assert res["monitor_steps"] == expected
        assert run.summary(rank)["steps"] == expected
        assert run.sample(rank, "ddpmon_steps_total") == expected


def check_norms(run: WorkerRun, steps: range, rel: float = 1e-5) -> None:
    """ddpmon's norm of every step in ``steps`` equals the one the trainer reported."""
    for rank in (0, 1):
        res = run.result(rank)
        theirs, ours = by_step(res["true_norms"]), by_step(res["ddpmon_norms"])
        for step in steps:
            assert step in theirs, f"rank {rank}: the trainer reported no norm for step {step}"
            assert step in ours, f"rank {rank}: ddpmon has no norm for step {step}: {ours}"
            assert close(ours[step], theirs[step], rel), (rank, step, ours[step], theirs[step])


def check_resume(run: WorkerRun, resume_at: int, steps: int, restored: set[str]) -> dict:
    """A run resumed from the checkpoint of step ``resume_at``: ddpmon numbers its steps from
    there (``resume_at`` .. ``steps - 1``, the trainer's own numbers) with the trainer's norms,
    records one load at ``resume_at`` and names ``restored`` as restored. Returns the
    manifest's ``recovery``."""
    for rank in (0, 1):
        res = run.result(rank)
        assert res["attached"], res["monitor_error"]
        assert res["global_step"] == steps
        ours, theirs = by_step(res["ddpmon_norms"]), by_step(res["true_norms"])
        assert sorted(ours) == list(range(resume_at, steps)), (ours, theirs)
        for step in ours:
            assert close(ours[step], theirs[step], 1e-5), (rank, step, ours[step], theirs[step])
        # The step gauge follows the trainer; the counter counts this launch's steps.
        assert run.sample(rank, "ddpmon_step") == steps - 1
        assert run.sample(rank, "ddpmon_steps_total") == steps - resume_at
        loads = [e for e in run.events(rank) if e["kind"] == "checkpoint_load"]
        assert [e["resume_step"] for e in loads] == [resume_at], loads
    recovery = run.manifest()["recovery"]
    assert recovery["resume_step"] == resume_at
    assert restored <= set(recovery["restored"]), recovery
    return recovery


def check_nan_origin(run: WorkerRun, rank: int, step: int, param: str | frozenset[str]) -> None:
    """The NaN injected into ``rank``'s local gradient is named with that rank, step and param
    (one of ``param`` when a set: the parameters that become ready together in backward);
    the other rank saw it only after the all-reduce."""
    origins = {
        r: [e for e in run.events(r) if e["kind"] == "nonfinite" and e.get("origin")]
        for r in (0, 1)
    }
    allowed = {param} if isinstance(param, str) else param
    assert [e["step"] for e in origins[rank]] == [step], origins[rank]
    assert origins[rank][0]["param"] in allowed, (origins[rank], allowed)
    assert origins[1 - rank] == []
    assert run.sample(rank, "ddpmon_grad_nonfinite_origin_steps_total") == 1
    assert run.sample(1 - rank, "ddpmon_grad_nonfinite_origin_steps_total") == 0
    assert run.sample(1 - rank, "ddpmon_grad_nonfinite_steps_total") == 1
    assert run.summary(rank)["first_nonfinite"]["step"] == step


def check_mismatch(run: WorkerRun, wrong_step: int, nan_step: int) -> None:
    """The scaled report at ``wrong_step`` and no other step fired the counter and the event
    (at ``nan_step`` both sides are NaN, which is agreement)."""
    for rank in (0, 1):
        assert run.result(rank)["observe_grad_norm"], "the agent has no observe_grad_norm"
        steps = [e["step"] for e in run.events(rank) if e["kind"] == "grad_norm_mismatch"]
        assert steps == [wrong_step], f"rank {rank}: mismatch events at steps {steps}"
        assert run.sample(rank, "ddpmon_grad_norm_mismatch_total") == 1
