"""Does a change leave the demo's numbers alone? Runs ``ddpmon demo`` (2 ranks, a fixed seed) at
a git ref and in this checkout, and compares every rank's history column by column.

Some columns differ between two runs of the same code (wall times, durations, memory): the ref
is run twice, and a column that differs between those two is timing, reported and left out.
Every other column must be bit-identical in this checkout; a column the ref wrote that this
checkout does not write is a failure, a new one is listed. Exit status 1 on any difference.

    .venv/bin/python scripts/history_identity.py --before ed0588e [--steps 60]

The ref is checked out with ``git worktree add --detach`` into a temporary directory (removed
after) and run with this checkout's virtual environment.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]


def free_base_port(count: int) -> int:
    """A port ``p`` with ``p .. p+count-1`` free just now (the demo's ranks use port+rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            held = []
            for i in range(count):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError("no run of free ports found")


def run_demo(checkout: Path, out: Path, steps: int, nproc: int) -> Path:
    """The demo's run dir after one run of ``checkout``'s code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "ddpmon.cli", "demo", "--nproc", str(nproc), "--steps",
           str(steps), "--seed", "0", "--run-dir", str(out), "--run-id", "identity",
           "--sd-dir", "none", "--no-progress", "--port", str(free_base_port(nproc))]
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"demo failed in {checkout}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return out / "identity"


def histories(run: Path) -> dict[int, dict[str, np.ndarray]]:
    """Per rank, each column as a flat array (list columns flattened), rows ordered by step."""
    out = {}
    for path in sorted(run.glob("history.rank*.arrow")):
        rank = int(path.name.split(".rank")[1].split(".")[0])
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        table = table.sort_by("step")
        out[rank] = {name: _flat(table.column(name)) for name in table.column_names}
    if not out:
        raise SystemExit(f"no history in {run}")
    return out


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    values = column.to_pylist()
    flat: list = []
    for v in values:
        if isinstance(v, list | tuple):
            flat.extend(["[", *v, "]"])
        elif isinstance(v, dict):
            flat.extend(["{", *sorted(v.items()), "}"])
        else:
            flat.append(v)
    return np.array([repr(v) for v in flat], dtype=object)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="git ref to compare against")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="history-identity-") as tmp:
        base = Path(tmp)
        ref = base / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(ref), args.before],
                       cwd=REPO, check=True)
        try:
            first = histories(run_demo(ref, base / "a", args.steps, args.nproc))
            second = histories(run_demo(ref, base / "b", args.steps, args.nproc))
            now = histories(run_demo(REPO, base / "c", args.steps, args.nproc))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=REPO,
                           check=False)
    return report(first, second, now, args.before)


def report(first, second, now, ref: str) -> int:
    failures, timing, checked, new = [], set(), set(), set()
    for rank, columns in first.items():
        if rank not in now:
            failures.append(f"rank {rank}: no history in this checkout")
            continue
        for name, values in columns.items():
            if not same(values, second[rank].get(name, np.array([]))):
                timing.add(name)
                continue
            checked.add(name)
            if name not in now[rank]:
                failures.append(f"rank {rank}: column {name} is gone")
            elif not same(values, now[rank][name]):
                failures.append(f"rank {rank}: column {name} differs")
        new |= set(now[rank]) - set(columns)
    print(f"history identity against {ref}: {len(first)} ranks, {len(checked)} columns "
          f"compared bit for bit")
    print(f"  left out (differ between two runs of {ref}): {', '.join(sorted(timing)) or '-'}")
    print(f"  new in this checkout: {', '.join(sorted(new)) or '-'}")
    for line in failures:
        print(f"  DIFFERS: {line}")
    print("  identical" if not failures else f"  {len(failures)} difference(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
