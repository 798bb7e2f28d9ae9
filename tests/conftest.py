"""Suite-wide rules, in one place:

- **Lanes.** Every test carries the markers of what it starts, applied here by directory (and by
  file where a directory mixes): ``ranks`` (torch.distributed ranks in subprocesses, torchrun,
  ``ddpmon demo``), ``services`` (a Debian-packaged server or tool: Prometheus, Alertmanager,
  promtool, VictoriaMetrics, ``ip netns``), ``browser`` (headless Chromium), ``gpu`` (CUDA only).
  ``make check`` runs ``-m "not ranks and not services and not browser and not gpu and not
  long"``: ``long`` marks a file that starts none of those but whose measured time
  (``tests/durations.json``) is at least ``LONG_SECONDS`` (many steps of a real loop, a
  fuzzer, a 3 GB file, the strict docs build), so the fast lane stays fast; ``make test`` runs
  every lane.
- **The markers cannot lie.** A test without ``ranks`` or ``services`` that starts such a
  process fails, naming the marker it needs (``subprocess.Popen`` is watched in this process).
- **No silent skips under CI.** With ``CI`` set (``.ci/run``, ``make test``) a skipped test fails,
  except the GPU tests on a machine without CUDA: a missing package or tool is an install bug
  there, not a reason to count a test that did not run.
- **Longest files first.** ``tests/durations.json`` holds each file's summed test time from a
  measured fresh-clone run (``scripts/test_durations.py``); files run longest first, so that
  under ``--dist loadfile --no-loadscope-reorder`` the last file to finish is a short one rather
  than the Slurm module alone on one worker while the others idle. A file it does not list
  counts as ``UNMEASURED_SECONDS``.
- **A lane leaves the other lanes' files unread.** Under ``-m`` naming lane markers only (``make
  check``'s), a file whose lane that expression deselects is not collected at all: each xdist
  worker would import it (Lightning, cloudcoil's models, torchtitan, ...) only to deselect every
  test in it.
- **One torch thread per pytest process** (``OMP_NUM_THREADS=1`` unless set): OpenMP workers
  spin-waiting on two shared cores cost several times the work of the op itself.
- **DeepSpeed's C++ ops come from this venv's own build** (``TORCH_EXTENSIONS_DIR``, the
  Makefile's path, built at install): a shared ``~/.cache/torch_extensions`` is rebuilt whenever
  another checkout's venv built it last, and a rank killed mid-build (a test timeout) leaves the
  build's lock file behind, on which every later load waits for ever.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# One intra-op thread in each pytest process, as each rank has (tests/support/ranks.py): three
# workers share two cores, and a torch op's OpenMP threads spin-wait for each other under that
# load (200 steps of tests/support/spikes.py's loop at a load of 17: 21 s and 4.1 CPU-s with two
# threads, 3.6 s and 0.8 CPU-s with one). Set before torch loads (OpenMP reads it once), and
# inherited by what the tests start; a caller's own OMP_NUM_THREADS stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin loaded torch first: its thread pool is already sized
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

DURATIONS = TESTS / "durations.json"
UNMEASURED_SECONDS = 30.0
"""A new file's guessed time until the durations are measured again: a typical rank test."""

LANE_MARKERS = ("ranks", "services", "browser", "gpu", "long")
LONG_SECONDS = 10.0
"""A file in no other lane is ``long`` when its measured time is at least this."""

LANES: dict[str, tuple[str, ...]] = {
    # directory (or file) under tests/ -> markers; the longest matching prefix wins
    "alerts/": ("services",),
    "alerts/test_cli.py": (),
    "alerts/test_rule_files.py": (),
    "alerts/test_stack_command.py": ("services",),
    "daemon/": (),
    "daemon/test_daemon_jobs.py": ("ranks",),
    "daemon/test_daemon_units.py": ("services",),
    "dashboards/": (),
    "dashboards/test_benchmark_smoke.py": ("services",),
    "dashboards/test_manifests.py": ("services",),
    "dashboards/test_promql.py": ("services",),
    "dashboards/test_series_profiles.py": ("services",),
    "docs/": (),
    "e2e/": ("ranks", "browser"),
    "forensics/": (),
    "forensics/test_damaged_rundirs.py": ("ranks",),
    "forensics/test_watchdog.py": ("ranks",),
    "gpu/": ("gpu", "ranks"),
    "integration/": ("ranks",),
    "integration/test_agent_ddp.py": ("ranks", "services"),
    "integration/test_alerts_live.py": ("ranks", "services"),
    "integration/test_hangs_live.py": ("ranks", "services"),
    "integration/test_hardware_or_numerics.py": ("ranks", "services"),
    "integration/test_dashboards_live.py": ("ranks", "services"),
    "integration/test_linger_live.py": ("ranks", "services"),
    "integration/test_stragglers_strategies.py": ("ranks", "services"),
    "integrations/": ("ranks",),
    "integrations/test_integration_parts.py": (),
    "multinode/": ("ranks", "services"),
    "parallel/": ("ranks",),
    "realscripts/": ("ranks",),
    "parallel/test_row_chunks.py": (),
    "scaleout/": ("services",),
    "scaleout/test_sharded_path.py": ("ranks", "services"),
    "security/": (),
    "security/test_discovery_squatting.py": ("ranks",),  # the daemon starts the demo's ranks
    "security/test_stack_escapes.py": ("services",),
    "slurm/": ("ranks", "services"),
    "sync/": ("ranks",),
    "sync/test_recorder.py": (),
    "unit/": (),
    "unit/test_collector.py": ("services",),
}

# Programs that put a test in a lane when it starts them (basename of argv[0], or the module of
# ``python -m``); ``ddpmon demo`` and ``torchrun`` start ranks.
SERVICE_PROGRAMS = frozenset(
    {"prometheus", "promtool", "prometheus-alertmanager", "alertmanager", "amtool",
     "victoria-metrics", "vmagent", "vmalert", "ip", "unshare", "nsenter", "munged",
     "slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel",
     "sacct", "sacctmgr", "mariadbd", "mariadb-install-db"}
)
BROWSER_PROGRAMS = frozenset({"chromium", "chromium-browser", "chrome", "headless_shell"})
RANK_PROGRAMS = frozenset({"torchrun"})
RANK_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


def lane_of(path: Path) -> tuple[str, ...]:
    """The markers of the test file at ``path`` (the longest matching prefix of ``LANES``)."""
    rel = path.resolve().relative_to(TESTS).as_posix()
    best = ""
    for prefix in LANES:
        if rel.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    if not best:
        raise pytest.UsageError(f"tests/{rel} is in no lane: add its directory to LANES")
    if not LANES[best] and _measured().get(f"tests/{rel}", 0.0) >= LONG_SECONDS:
        return ("long",)
    return LANES[best]


@functools.cache
def _measured() -> dict[str, float]:
    return file_durations()


def lane_deselects(markexpr: str, markers: tuple[str, ...]) -> bool:
    """Whether ``-m markexpr`` deselects every test that carries exactly the lane ``markers``.
    Only an expression of lane markers, ``and``, ``or``, ``not`` and parentheses is judged (a
    test's lane markers are all it can carry of those); anything else is False: collect."""
    words = re.findall(r"\(|\)|[^\s()]+", markexpr)
    if not words or any(w not in ("and", "or", "not", "(", ")", *LANE_MARKERS) for w in words):
        return False
    code = " ".join(str(w in markers) if w in LANE_MARKERS else w for w in words)
    try:
        return not eval(code, {"__builtins__": {}})  # only True, False, and, or, not, ( )
    except SyntaxError:
        return False  # pytest names the bad expression itself


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    markexpr = config.getoption("markexpr", "")
    if markexpr and lane_deselects(markexpr, lane_of(collection_path)):
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name, what in (
        ("ranks", "starts torch.distributed ranks in subprocesses (torchrun, ddpmon demo)"),
        ("services", "starts a Debian-packaged server or tool (Prometheus, promtool, ...)"),
        ("browser", "drives headless Chromium"),
        ("gpu", "needs CUDA"),
        ("long", "in no other lane, but measured at LONG_SECONDS or more (tests/durations.json)"),
    ):
        config.addinivalue_line("markers", f"{name}: {what}")


def file_durations() -> dict[str, float]:
    """``tests/durations.json``: ``{"tests/dir/test_x.py": seconds}`` (empty when absent)."""
    try:
        raw = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in raw.items()}


def longest_files_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """``items`` with each file's tests kept together and in order, files longest first."""
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], index)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return (-durations.get(path, UNMEASURED_SECONDS), first_seen[path])

    return sorted(items, key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in lane_of(Path(str(item.path))):
            item.add_marker(getattr(pytest.mark, name))
    items[:] = longest_files_first(items, file_durations())


def lane_needed(args: object, env: dict | None) -> str | None:
    """The marker a ``Popen(args, env=env)`` call needs, or None."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    argv = [os.fsdecode(a) for a in argv]
    if len(argv) == 1 and " " in argv[0]:  # shell=True style command line
        argv = argv[0].split()
    if not argv:
        return None
    program = Path(argv[0]).name
    if program in SERVICE_PROGRAMS:
        return "services"
    if program in BROWSER_PROGRAMS:
        return "browser"
    if program in RANK_PROGRAMS:
        return "ranks"
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] in RANK_MODULES:
        return "ranks"
    if program == "ddpmon" or (argv[1:2] == ["-m"] and argv[2:3] in (["ddpmon"], ["ddpmon.cli"])):
        rest = argv[1:] if program == "ddpmon" else argv[3:]
        if rest[:1] in (["demo"], ["stack"], ["scaleout"]):
            return "ranks" if rest[0] == "demo" else "services"
    if "-c" in argv[1:-1]:  # python -c CODE: a rank script written inline
        code = argv[argv.index("-c") + 1]
        if "init_process_group" in code and "world_size=1" not in code:
            return "ranks"
    if env is not None:
        try:
            if int(env.get("WORLD_SIZE", "1")) > 1:
                return "ranks"
        except ValueError:
            pass
    return None


@pytest.fixture(autouse=True)
def _lane_audit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fail a test that starts what its markers do not declare (see the module doc)."""
    declared = {m.name for m in request.node.iter_markers() if m.name in LANE_MARKERS}
    original = subprocess.Popen.__init__

    def watched(self, args, *a, **kw):
        needed = lane_needed(args, kw.get("env"))
        if needed is not None and needed not in declared:
            pytest.fail(
                f"{request.node.nodeid} starts {args!r} but is not marked {needed!r}: add its "
                "file to LANES in tests/conftest.py",
                pytrace=False,
            )
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if not os.environ.get("CI") or call.excinfo is None:
        return None
    if not call.excinfo.errisinstance(pytest.skip.Exception):
        return None
    if item.get_closest_marker("gpu") is not None:
        return None  # CUDA tests skip on a CPU machine by design
    reason = str(call.excinfo.value)
    report = pytest.TestReport.from_item_and_call(item, call)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI ({reason}): CI installs everything the suite needs"
    return report


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A whole module skipped at import (a missing package or tool) fails under CI, too."""
    if os.environ.get("CI") and report.skipped and "tests/gpu/" not in report.nodeid:
        report.outcome = "failed"


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo world and its 1-D CPU mesh (torn down after the module): a real process
    group, so DTensors have real placements and collectives return a real ``Work``, at world
    size 1 in the test's own process (no ``ranks`` marker needed)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
