"""Helpers for the framework-integration tests: run a multi-process worker and read what it left.

Each worker writes ``result.rank<R>.json`` (the trainer's per-step numbers as it logged them,
ddpmon's per-step numbers as its state showed them, the final exposition) next to ddpmon's own
run directory (events, summaries). Workers run in their own session; on timeout the whole process
group is killed, so no rank outlives its test.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

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

    def summary(self, rank: int) -> dict:
        path = self.out / "runs" / RUN_ID / f"summary.rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no ddpmon summary; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    def sample(self, rank: int, name: str) -> float | None:
        """Value of an unlabelled-beyond-run/rank sample in rank's final exposition."""
        text = self.result(rank).get("exposition") or ""
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        return None


def run_worker(
    cmd: list[str], out: Path, timeout: float, extra_env: dict | None = None
) -> WorkerRun:
    """Run ``cmd`` (a launcher that starts every rank) in its own session with a hard timeout."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra_env or {}))
    env.pop("DDPMON_PORT", None)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        output, _ = proc.communicate()
        raise AssertionError(
            f"worker timed out after {timeout}s:\n{output.decode()[-4000:]}"
        ) from None
    finally:
        _kill_group(proc.pid)
    return WorkerRun(proc.returncode, output.decode(errors="replace"), out)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python() -> str:
    return sys.executable


def close(a: float, b: float, rel: float) -> bool:
    """Relative equality; both non-finite counts as equal (a NaN step on both sides)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


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
