"""Store, node collector, outcome analysis, settings and token file: no subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddpmon.daemon import outcome
from ddpmon.daemon.node import NodeCollector, build_registry
from ddpmon.daemon.ranks import RankRegistry, RegistrationRefused
from ddpmon.daemon.settings import DaemonSettings, SettingsError
from ddpmon.daemon.store import DuplicateJobError, JobRecord, Store
from ddpmon.daemon.token import TokenFileError, load_or_create
from ddpmon.sources.nvml import NvmlSource
from ddpmon.web.agent_socket import Peer


def test_store_persists_and_rejects_duplicates(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    job = JobRecord(id="a1", entrypoint="demo", nproc=2, args=["--steps", "3"])
    store.insert_job(job)
    with pytest.raises(DuplicateJobError):
        store.insert_job(JobRecord(id="a1", entrypoint="demo", nproc=1))
    job.state, job.ranks = "FAILED", {"1": {"signal": 11}}
    store.save_job(job)
    store.put_rank("a1", 0, {"run": "a1", "rank": 0, "pid": 1})
    store.close()

    reopened = Store(tmp_path / "db.sqlite3")
    got = reopened.get_job("a1")
    assert got is not None and got.state == "FAILED" and got.ranks == {"1": {"signal": 11}}
    assert got.args == ["--steps", "3"]
    assert reopened.count_by_state()["FAILED"] == 1
    assert [r["rank"] for r in reopened.iter_ranks()] == [0]
    assert reopened.get_job("nope") is None


class FakeNvml:
    """Two GPUs; the second has no power reading (unsupported board)."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:  # noqa: N802
        return f"GPU-{h}".encode()

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return "FakeGPU"

    def nvmlDeviceGetMemoryInfo(self, h: int):  # noqa: N802
        return SimpleNamespace(used=1000 * (h + 1), total=8000)

    def nvmlDeviceGetUtilizationRates(self, h: int):  # noqa: N802
        return SimpleNamespace(gpu=50 + h)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        return 60 + h

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        if h == 1:
            raise self.NVMLError("not supported")
        return 250_000

    def nvmlDeviceGetPciInfo(self, h: int):  # noqa: N802
        return SimpleNamespace(busId=f"0000:0{h}:00.0")

    def nvmlDeviceGetTotalEccErrors(self, h: int, a: int, b: int) -> int:  # noqa: N802
        return 3 * h


class BrokenNvml(FakeNvml):
    def nvmlInit(self) -> None:  # noqa: N802
        raise self.NVMLError("NVML Shared Library Not Found")


def _scrape(collector: NodeCollector) -> dict[tuple[str, tuple], float]:
    text = generate_latest(build_registry(collector)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_node_collector_reports_every_gpu_and_host(tmp_path: Path) -> None:
    c = NodeCollector(
        node="n1",
        nvml=NvmlSource(FakeNvml()),
        job_counts=lambda: {"RUNNING": 2},
        live_ranks=lambda: 4,
        disk_paths=(str(tmp_path),),
    )
    got = _scrape(c)
    assert got[("ddpmon_collector_success", (("collector", "nvml"),))] == 1
    assert got[("ddpmon_gpu_memory_used_bytes", (("gpu", "1"),))] == 2000
    assert got[("ddpmon_gpu_utilization_ratio", (("gpu", "0"),))] == pytest.approx(0.50)
    assert got[("ddpmon_gpu_power_watts", (("gpu", "0"),))] == 250
    assert ("ddpmon_gpu_power_watts", (("gpu", "1"),)) not in got
    assert got[("ddpmon_gpu_ecc_uncorrected_errors_total", (("gpu", "1"),))] == 3
    assert got[("ddpmon_node_gpus", ())] == 2
    assert got[("ddpmon_daemon_jobs", (("state", "RUNNING"),))] == 2
    assert got[("ddpmon_daemon_jobs", (("state", "FAILED"),))] == 0
    assert got[("ddpmon_daemon_registered_ranks", ())] == 4
    assert got[("ddpmon_node_memory_total_bytes", ())] == psutil.virtual_memory().total
    assert got[("ddpmon_node_disk_total_bytes", (("path", str(tmp_path)),))] > 0
    assert got[("ddpmon_collector_success", (("collector", "host"),))] == 1


def test_node_collector_without_nvml_reports_zero_success() -> None:
    got = _scrape(NodeCollector(node="n1", nvml=NvmlSource(BrokenNvml())))
    assert got[("ddpmon_collector_success", (("collector", "nvml"),))] == 0
    assert not any(name.startswith("ddpmon_gpu_") for name, _ in got)
    assert got[("ddpmon_collector_success", (("collector", "host"),))] == 1


def test_node_exposition_passes_promtool() -> None:
    text = generate_latest(
        build_registry(NodeCollector(node="n1", nvml=NvmlSource(FakeNvml()), live_ranks=lambda: 0))
    )
    res = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert res.returncode == 0, res.stderr.decode() + res.stdout.decode()


def _events(path: Path, rank: int, events: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"events.rank{rank}.jsonl", "w") as fh:
        for e in events:
            fh.write(json.dumps({"rank": rank, **e}) + "\n")
        fh.write('{"ts": 1, "kind": "torn')  # a killed rank's last line


def test_first_failure_prefers_cause_over_consequences(tmp_path: Path) -> None:
    _events(tmp_path, 0, [
        {"ts": 10.0, "step": None, "kind": "start"},
        {"ts": 20.5, "step": 7, "kind": "nonfinite", "origin": False},
        {"ts": 21.0, "step": 7, "kind": "signal", "signal": "SIGTERM"},
    ])  # fmt: skip
    _events(tmp_path, 1, [
        {"ts": 10.1, "step": None, "kind": "start"},
        {"ts": 20.6, "step": 7, "kind": "nonfinite", "origin": True, "param": "w"},
        {"ts": 25.0, "step": 9, "kind": "exit", "code": 0},
    ])  # fmt: skip
    found = outcome.event_failures(tmp_path)
    kinds = {(f["rank"], f["kind"]) for f in found}
    assert kinds == {(0, "nonfinite"), (0, "signal"), (1, "nonfinite")}
    first = outcome.first_failure(found)
    assert first is not None and first["rank"] == 1 and first["param"] == "w"

    torchrun = [
        {"rank": 0, "ts": 30.0, "source": "torchrun", "kind": "signal", "signal": 15},
        {"rank": 1, "ts": 30.0, "source": "torchrun", "kind": "signal", "signal": 11},
    ]
    first = outcome.first_failure(torchrun)
    assert first is not None and (first["rank"], first["signal"]) == (1, 11)
    assert outcome.first_failure([]) is None


def test_a_peers_connection_error_is_a_consequence_of_the_crash(tmp_path: Path) -> None:
    """Rank 1 dies of SIGSEGV; rank 0's gloo call then raises "Connection closed by peer" and
    its log records the exception 0.9 s later. torchrun stamps rank 1's failure in whole
    seconds, so the exception may look earlier or later than the crash: either way rank 1's
    signal is the cause (a CI run under load reported rank 0's exception instead)."""
    message = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:23942. This is typically caused by a remote worker crashing.")
    _events(tmp_path, 0, [
        {"ts": 100.2, "step": None, "kind": "start"},
        {"ts": 100.9, "step": None, "kind": "exit", "reason": "exception", "code": 1,
         "exc_type": "RuntimeError", "message": message},
    ])  # fmt: skip
    crashed = {"rank": 1, "ts": 100.0, "source": "torchrun", "kind": "signal", "signal": 11}
    exited = {"rank": 0, "ts": 100.0, "source": "torchrun", "kind": "exit", "exit_code": 1}
    logged = outcome.event_failures(tmp_path)
    assert [(f["rank"], f["kind"]) for f in logged] == [(0, "exit")]
    for failures in ([*logged, crashed], [*logged, exited, crashed], [exited, *logged, crashed]):
        first = outcome.first_failure(failures)
        assert first is not None and (first["rank"], first.get("signal")) == (1, 11), failures
    # an exception of the training code itself (no peer in it) stays a cause
    _events(tmp_path, 0, [{"ts": 99.5, "step": 3, "kind": "exit", "reason": "exception",
                           "code": 1, "exc_type": "ValueError", "message": "bad shape"}])
    first = outcome.first_failure([*outcome.event_failures(tmp_path), exited, crashed])
    assert first is not None and (first["rank"], first["exc_type"]) == (0, "ValueError")


def test_loss_scale_floor_that_stopped_the_run_is_the_first_failure(tmp_path: Path) -> None:
    """Many overflows the scaler absorbed (more than the per-file quota), then the floor policy
    raised: the floor is the cause; with only a recorded floor the origin overflow stays it."""
    absorbed = [
        {"ts": 11.0 + i, "step": i, "kind": "nonfinite", "origin": True, "skipped_by": "scaler"}
        for i in range(8)
    ]
    floor = {"ts": 30.0, "step": 9, "kind": "loss_scale_floor", "action": "raise",
             "source": "ddpmon"}
    _events(tmp_path, 1, [{"ts": 10.0, "step": None, "kind": "start"}, *absorbed, floor])
    first = outcome.first_failure(outcome.event_failures(tmp_path))
    assert first is not None and (first["kind"], first["step"]) == ("loss_scale_floor", 9)
    _events(tmp_path, 1, [*absorbed, {**floor, "action": "record"}])
    first = outcome.first_failure(outcome.event_failures(tmp_path))
    assert first is not None and (first["kind"], first["step"]) == ("nonfinite", 0)


def test_settings_validation(tmp_path: Path) -> None:
    cfg = tmp_path / "d.yaml"
    cfg.write_text("entrypoints: {x: {module: a.b}}\nmax_nproc: 2\n")
    s = DaemonSettings.load(cfg)
    assert s.entrypoints["x"].argv() == ["-m", "a.b"] and s.max_nproc == 2
    for bad in (
        "max_nproc: 0\n",
        "entrypoints: {x: {module: a, script: b}}\n",
        "entrypoints: {x: {command: 'rm -rf /'}}\n",
        "bogus: 1\n",
        "port_range: [10, 5]\n",
    ):
        cfg.write_text(bad)
        with pytest.raises(SettingsError):
            DaemonSettings.load(cfg)


def test_token_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "token"
    token = load_or_create(path)
    assert len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(path) == token
    os.chmod(path, 0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        load_or_create(path)


LISTENER = """
import socket, time
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
time.sleep(30)
"""


def test_rank_registry_drops_dead_processes(tmp_path: Path) -> None:
    reg = RankRegistry(Store(tmp_path / "db.sqlite3"))
    child = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        child_port = int(child.stdout.readline())
        with socket.create_server(("127.0.0.1", 0)) as own:
            base = {"run": "r", "local_rank": 0, "node": "n", "host": "127.0.0.1"}
            me = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
            reg.register({**base, "rank": 0, "port": own.getsockname()[1]}, me)
            them = Peer(pid=child.pid, uid=os.getuid(), gid=os.getgid())
            reg.register({**base, "rank": 1, "port": child_port, "job_id": "j"}, them)
            sd = reg.http_sd()
            assert [g["labels"]["rank"] for g in sd] == ["0", "1"]
            assert sd[1]["labels"]["job_id"] == "j" and "job" not in sd[1]["labels"]
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            assert [g["labels"]["rank"] for g in reg.http_sd()] == ["0"]
            with pytest.raises(RegistrationRefused, match="not a running process"):
                reg.register({**base, "rank": 2, "port": child_port}, them)
    finally:
        child.kill()
        child.wait(timeout=10)
