"""``make gpu-check``: everything that needs a GPU, in one call, into one JSON of figures.

Steps, each timed and recorded as ``ok``, ``failed`` or ``skipped`` (with the reason):

1. ``tests/gpu`` (pytest): the agent's hot path under CUDA's sync debug mode, NVML series;
2. the sync audit (tests/sync/_audit_worker.py, one rank): plain, DDP, FSDP2 and TP loops,
   with and without a GradScaler, monitored against unmonitored, with torch's CUDA sync debug
   mode (``warn``) on during every step; on a machine without CUDA the same loops run on the
   CPU with ``DDPMON_SYNC_AUDIT=1`` (the multi-rank strategies are in ``make test``);
3. NVML readings (pynvml): each GPU's name, memory, power, utilisation, temperature, clocks;
4. the overhead benchmark (benchmarks/gpu_overhead.py) on the largest model that fits one GPU.

Without CUDA the steps that need it are skipped with one line each and the exit status is 0;
a failed step makes it 1. The whole run keeps within ``--budget`` seconds (default 480): a step
that would start past it is skipped and says so.

Usage: python scripts/gpu_check.py [--out gpu-check.json] [--budget 480]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

AUDIT_RUNS = ("plain", "plain+scaler", "ddp", "ddp+scaler", "fsdp2", "fsdp2+scaler", "tp")


class Skip(Exception):
    """A step that cannot run here: the message says why."""


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def environment() -> dict:
    import torch

    import ddpmon

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddpmon": getattr(ddpmon, "__version__", "?"),
        "cuda_available": torch.cuda.is_available(),
        "commit": _git("rev-parse", "HEAD"),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_tests(left: float) -> dict:
    if not cuda():
        raise Skip("tests/gpu needs CUDA (torch.cuda.is_available() is False)")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests/gpu"], cwd=REPO, capture_output=True, text=True, timeout=min(left, 240),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail[0])}
    if done.returncode != 0:
        raise RuntimeError(f"pytest tests/gpu exited {done.returncode}: {tail[0]}\n"
                           + (done.stdout + done.stderr)[-3000:])
    return {"summary": tail[0], **counts}


def sync_audit(left: float) -> dict:
    from tests.support.ranks import run_ranks
    from tests.support.sync_audit import added_ops

    on_gpu = cuda()
    env = {"PYTHONWARNINGS": "ignore"} if on_gpu else {"DDPMON_SYNC_AUDIT": "1"}
    args = ["--runs", ",".join(AUDIT_RUNS), "--device", "cuda" if on_gpu else "cpu"]
    with tempfile.TemporaryDirectory() as out:
        ranks = run_ranks(REPO / "tests" / "sync" / "_audit_worker.py", Path(out), args,
                          world=1, env=env, timeout=min(left, 300))
    runs, failed = {}, []
    for run, result in ranks[0]["runs"].items():
        mon, base = result["monitored"], result["unmonitored"]
        added = added_ops(mon["training"], base["training"])
        runs[run] = {"added": added, "monitored": mon["training"], "unmonitored": base["training"],
                     "ddpmon_threads": mon["ddpmon_threads"], "where": mon["where"],
                     "agent_errors": sum(mon["agent_errors"].values())}
        if added or runs[run]["agent_errors"]:
            failed.append(run)
    mode = ("CUDA, torch's sync debug mode on every step" if on_gpu
            else "CPU with DDPMON_SYNC_AUDIT=1 (no CUDA here)")
    if failed:
        raise RuntimeError(f"the monitored loop added host syncs in {failed}: "
                           + json.dumps({r: runs[r]["added"] for r in failed}))
    return {"mode": mode, "runs": runs}


def nvml(left: float) -> dict:
    if not cuda():
        raise Skip("NVML readings need an NVIDIA GPU (torch.cuda.is_available() is False)")
    try:
        import pynvml
    except ImportError:
        raise Skip("pynvml is not installed (pip install nvidia-ml-py)") from None
    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append({
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_used_bytes": mem.used, "memory_total_bytes": mem.total,
                "power_watts": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "utilization_percent": util.gpu,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            })
        return {"gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def overhead(left: float) -> dict:
    if not cuda():
        raise Skip("the GPU overhead benchmark needs CUDA (CPU overhead figures: make bench)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        done = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "gpu_overhead.py"), "--json", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=min(left, 300),
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        if done.returncode != 0:
            raise RuntimeError(f"gpu_overhead.py exited {done.returncode}:\n"
                               + (done.stdout + done.stderr)[-3000:])
        return json.loads(out.read_text())


STEPS: tuple[tuple[str, Callable[[float], dict]], ...] = (
    ("gpu_tests", gpu_tests),
    ("sync_audit", sync_audit),
    ("nvml", nvml),
    ("overhead", overhead),
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check.json")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--only", default=None, help="comma-separated steps (default: all)")
    args = p.parse_args()
    wanted = args.only.split(",") if args.only else [name for name, _ in STEPS]
    started = time.monotonic()
    report: dict = {"environment": environment(), "steps": {}}
    for name, step in STEPS:
        if name not in wanted:
            continue
        left = args.budget - (time.monotonic() - started)
        t0 = time.monotonic()
        if left < 20:
            entry = {"status": "skipped", "reason": f"over the {args.budget:g} s budget"}
        else:
            try:
                entry = {"status": "ok", **step(left)}
            except Skip as why:
                entry = {"status": "skipped", "reason": str(why)}
            except Exception as exc:  # a failed step is reported, the others still run
                entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:4000]}
        entry["seconds"] = round(time.monotonic() - t0, 1)
        report["steps"][name] = entry
        note = entry.get("reason") or entry.get("error", "").split("\n")[0]
        print(f"gpu-check: {name}: {entry['status']} ({entry['seconds']} s)"
              + (f": {note}" if note else ""), flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["skipped"] = [n for n, e in report["steps"].items() if e["status"] == "skipped"]
    report["failed"] = [n for n, e in report["steps"].items() if e["status"] == "failed"]
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu-check: wrote {args.out} ({report['seconds']} s; "
          f"skipped: {', '.join(report['skipped']) or 'none'}; "
          f"failed: {', '.join(report['failed']) or 'none'})")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
