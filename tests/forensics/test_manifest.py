import json

from ddpmon.cli import main
from ddpmon.config import Config
from ddpmon.job.identity import RankIdentity, build_versions
from ddpmon.recorder.manifest import (
    CHECKLIST,
    REDACTED,
    build_manifest,
    check_manifest,
    redact_env,
    write_manifest,
    write_run_manifest,
)

ENV = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "NCCL_DEBUG": "INFO",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "DDPMON_WEB_CONFIG": "/etc/web.yml",
    "DDPMON_AUTH_TOKEN": "hunter2",
    "NCCL_IB_SECRET_KEY": "s3cr3t",
    "TORCH_HUB_PASSWORD": "pw",
    "DDPMON_DAEMON_URL": "https://alice:opensesame@daemon:7469/",
    "HOME": "/root",
    "AWS_SECRET_ACCESS_KEY": "never-listed",
    "RANK": "0",
}


class FakeNvml:
    """The NvmlSource interface on a machine with one NVLinked GPU."""

    available = True
    error = None

    class _Reading:
        index, uuid, name = 0, "GPU-1234", "H100"
        pci_bus_id, memory_total_bytes = "00000000:3B:00.0", 80e9

    class _Module:
        NVML_NVLINK_MAX_LINKS = 3

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return i

        @staticmethod
        def nvmlDeviceGetNvLinkState(handle, link):
            return link != 1

        @staticmethod
        def nvmlDeviceGetNvLinkRemotePciInfo(handle, link):
            return type("Pci", (), {"busId": b"00000000:5E:00.0"})()

    _nvml = _Module()

    def read(self):
        return [self._Reading()]

    def driver_version(self):
        return "550.54"


class NoNvml:
    available = False
    error = "NVMLError_LibraryNotFound"


def _identity(rank=0):
    return RankIdentity(rank=rank, local_rank=rank, world_size=2, node="n1", backend="gloo",
                        device="cpu", pid=123)


def test_redaction():
    env = redact_env(ENV)
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["NCCL_DEBUG"] == "INFO"
    assert env["DDPMON_WEB_CONFIG"] == "/etc/web.yml" and env["RANK"] == "0"
    for secret in ("DDPMON_AUTH_TOKEN", "NCCL_IB_SECRET_KEY", "TORCH_HUB_PASSWORD"):
        assert env[secret] == REDACTED
    assert env["DDPMON_DAEMON_URL"] == f"https://alice:{REDACTED}@daemon:7469/"
    assert "HOME" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert not any(v in json.dumps(env) for v in ("hunter2", "s3cr3t", "opensesame"))


def test_full_manifest_passes_check_and_records_topology(tmp_path):
    m = build_manifest(
        identity=_identity(),
        config=Config(data_version="shards-v3", daemon_url="http://bob:pw@d:1/"),
        versions={**build_versions(), "cuda_version": "12.4", "nccl_version": "2.21.5"},
        extra={"run_id": "r1", "batch_shapes": [[8, 32]], "precision": "bf16",
               "seeds": {"user_seed": 7}},
        environ=ENV,
        nvml=FakeNvml(),
    )
    assert m["versions"]["driver"] == "550.54" and m["versions"]["cuda"] == "12.4"
    gpu = m["topology"]["gpus"][0]
    assert gpu["pci_bus_id"] == "00000000:3B:00.0"
    assert [link["link"] for link in gpu["nvlink"]] == [0, 2]
    assert gpu["nvlink"][0]["remote_pci_bus_id"] == "00000000:5E:00.0"
    assert m["seeds"]["user_seed"] == 7 and "torch_cpu" in m["seeds"]
    assert m["config"]["daemon_url"] == f"http://bob:{REDACTED}@d:1/"
    path = write_manifest(tmp_path, m)
    assert path.name == "manifest.json"
    assert check_manifest(tmp_path) == []
    assert main(["manifest", str(tmp_path), "--check"]) == 0
    assert "pw@" not in path.read_text() and "hunter2" not in path.read_text()


def test_check_lists_missing_items(tmp_path, capsys):
    m = build_manifest(identity=_identity(), config=Config(), versions=build_versions(),
                       extra={"precision": "fp32"}, environ=ENV, nvml=NoNvml())
    write_manifest(tmp_path, m)
    missing = check_manifest(tmp_path)
    assert missing == ["batch_shapes", "data_version"]
    assert set(missing) < set(CHECKLIST)
    capsys.readouterr()
    assert main(["manifest", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "missing: batch_shapes" in out and "missing: data_version" in out
    assert "n/a: versions.driver" in out  # explained, not silently absent


def test_only_rank_0_writes_the_one_manifest(tmp_path):
    m = build_manifest(identity=_identity(rank=1), config=Config(), versions=build_versions(),
                       extra={}, environ=ENV, nvml=NoNvml())
    assert write_manifest(tmp_path, m) is None
    assert list(tmp_path.iterdir()) == []  # no per-rank copy
    assert check_manifest(tmp_path) == ["manifest.json"]


def test_write_run_manifest_builds_and_writes_once_on_rank_0(tmp_path):
    hosts = [{"rank": r, "node": "n1", "local_rank": r, "pid": 100 + r} for r in (0, 1)]
    kwargs = dict(config=Config(data_version="v1"), versions=build_versions(),
                  extra={"run_id": "r1", "batch_shapes": [[8, 32]], "precision": "fp32",
                         "hosts": hosts},
                  environ=ENV, nvml=NoNvml())
    assert write_run_manifest(tmp_path, identity=_identity(rank=1), **kwargs) is None
    assert list(tmp_path.iterdir()) == []
    path = write_run_manifest(tmp_path, identity=_identity(rank=0), **kwargs)
    assert path == tmp_path / "manifest.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temp file left
    data = json.loads(path.read_text())
    assert data["run_id"] == "r1" and data["topology"]["hosts"] == hosts
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)  # readable like the rest of the run
    assert check_manifest(tmp_path) == []


def test_manifest_command_without_a_run(tmp_path, capsys):
    assert main(["manifest", str(tmp_path), "--check"]) == 2
    assert "no ddpmon run" in capsys.readouterr().err
