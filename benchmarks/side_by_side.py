"""What the benchmarks that set another version of ddpmon beside this one share: the old
``ddpmon`` package taken from git, one run of this checkout's harness under a chosen package,
the figures read from the section it prints, and the per-round ratio's median and range.

A harness stays this checkout's (the same model, loop and clocks for both); only ``PYTHONPATH``
says which ``ddpmon`` it imports, so the two differ in the agent alone. Rounds run both
versions back to back in a shuffled order: a machine shared with other work moves both alike
within a round, not across rounds, which is why ratios are taken per round
(``host_cost_vs_first.py``, ``before_after.py``).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HOST_COST = re.compile(r"\| training-thread CPU \| (\d+) us \| (\d+) us \| \*\*(-?\d+) us\*\*")
"""host_cost.py's training-thread row: unmonitored step, monitored step, agent cost (us)."""


def extract(commit: str, into: Path) -> None:
    """The ``ddpmon`` package of ``commit`` under ``into`` (raises when git cannot)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "ddpmon"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_harness(script: str, args: list[str], pythonpath: Path, timeout: float = 1800) -> str:
    """The stdout of ``benchmarks/<script> args`` importing the ``ddpmon`` under
    ``pythonpath``; a harness that fails raises with the tail of its output."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{script} under {pythonpath} failed ({out.returncode}):\n"
                           f"{out.stdout[-800:]}\n{out.stderr[-1500:]}")
    return out.stdout


def host_cost_figures(stdout: str) -> tuple[int, int, int]:
    """(unmonitored step, monitored step, agent cost) in us from host_cost.py's output."""
    match = HOST_COST.search(stdout)
    if match is None:
        raise RuntimeError(f"host_cost.py printed no training-thread row:\n{stdout[-800:]}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def table_ratio(stdout: str, row: str) -> float:
    """The median column (``1.123x``) of the markdown row whose first cell starts with
    ``row`` in a harness's printed section."""
    match = re.search(rf"^\| {re.escape(row)}[^|]*\| (-?[\d.]+)x \|", stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no row {row!r} in:\n{stdout[-800:]}")
    return float(match.group(1))


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    return statistics.median(values), min(values), max(values)


def per_round(new: list[float], old: list[float]) -> list[float]:
    """new / old for each round (rounds where old is not positive are left out)."""
    return [n / o for n, o in zip(new, old, strict=True) if o > 0]


def load_average() -> float:
    """The machine's 1-minute load average now."""
    return os.getloadavg()[0]


def uptime() -> str:
    """``uptime``'s line (load averages over 1, 5 and 15 minutes), for the report."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"

