"""The one atomic write and the one JSON sanitiser every ddpmon file goes through."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from ddpmon.recorder.eventlog import jsonable
from ddpmon.rundir.atomic import (
    dumps,
    json_safe,
    publish_dir,
    write_bytes_atomic,
    write_file_synced,
    write_json_atomic,
)


def _strict(text: str):
    def refuse(token: str):
        raise AssertionError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_safe_makes_strict_json_of_anything(tmp_path: Path) -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd!"

    value = {
        1: float("nan"),
        "inf": [float("inf"), (float("-inf"), 2.5)],
        "tensor": torch.tensor(3.5),
        "vector": torch.tensor([1.0, 2.0]),
        "path": tmp_path,
        "odd": Odd(),
        "set": {7},
        "ok": [None, True, 3, "s"],
    }
    out = _strict(dumps(value))
    assert out["1"] == "nan" and out["inf"] == ["inf", ["-inf", 2.5]]
    assert out["tensor"] == 3.5 and out["vector"].startswith("tensor(")
    assert out["path"] == str(tmp_path) and out["odd"] == "odd!" and out["set"] == [7]
    assert out["ok"] == [None, True, 3, "s"]
    assert jsonable is json_safe  # the event log uses the same sanitiser
    deep: list = []
    cur = deep
    for _ in range(20):
        cur.append([])
        cur = cur[0]
    assert isinstance(json.dumps(json_safe(deep)), str)  # bounded depth, no recursion error
    with pytest.raises(ValueError):
        json.dumps(float("nan"), allow_nan=False)  # why the sanitiser exists
    assert math.isnan(float(json_safe(float("nan"))))


def test_write_json_atomic_is_strict_readable_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "summary.rank0.json"
    path = write_json_atomic(target, {"loss": float("inf"), "b": 1, "a": 2})
    assert path == target
    text = target.read_text()
    assert text.endswith("\n") and list(_strict(text)) == ["a", "b", "loss"]  # sorted
    assert _strict(text)["loss"] == "inf"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    write_json_atomic(target, {"x": 1}, mode=0o600)
    assert oct(target.stat().st_mode & 0o777) == oct(0o600)
    assert os.listdir(target.parent) == ["summary.rank0.json"]


def test_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    write_bytes_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_bytes_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.json"]


WRITER = """
import sys
from ddpmon.rundir.atomic import write_bytes_atomic
target, n = sys.argv[1], 0
print("ready", flush=True)
while True:
    n += 1
    write_bytes_atomic(target, (str(n) + "|").encode() * 200_000 + b"end")
"""


def test_a_writer_killed_mid_write_never_leaves_a_torn_file(tmp_path: Path, procs) -> None:
    target = tmp_path / "ddpmon-r-rank0.json"
    write_bytes_atomic(target, b"0|end")
    proc = procs.start(WRITER, str(target))
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60  # killed once it has replaced the file at least twice
    while int(target.read_bytes().split(b"|", 1)[0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    data = target.read_bytes()
    assert data.endswith(b"end")
    head = data.split(b"|", 1)[0]
    assert int(head) > 0, "the writer never completed a write"
    assert data == (head + b"|") * 200_000 + b"end"  # one whole version, never a mix
    # whatever the kill interrupted is a hidden temp file that a `*.json` glob never reads
    assert [p.name for p in tmp_path.glob("*.json")] == [target.name]
    assert all(p.name.startswith(".") and p.name.endswith(".tmp")
               for p in tmp_path.iterdir() if p != target)


def test_publish_dir_renames_a_complete_directory_and_never_replaces_one(tmp_path: Path) -> None:
    tmp = tmp_path / ".tmp-x"
    tmp.mkdir()
    write_file_synced(tmp / "info.json", '{"a": 1}\n')
    write_file_synced(tmp / "t.bin", b"\x00\x01")
    final = publish_dir(tmp, tmp_path / "bundle")
    assert final == tmp_path / "bundle" and not tmp.exists()
    assert json.loads((final / "info.json").read_text()) == {"a": 1}
    other = tmp_path / ".tmp-y"
    other.mkdir()
    (other / "f").write_text("x")
    with pytest.raises(OSError):
        publish_dir(other, final)
    assert (final / "t.bin").read_bytes() == b"\x00\x01"
