"""FileSDPublisher: the file Prometheus reads, atomic replacement, idempotent removal."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from ddpmon.export.discovery import FileSDPublisher


def _publisher(sd_dir: Path, rank: int = 1) -> FileSDPublisher:
    return FileSDPublisher(
        sd_dir,
        target=f"127.0.0.1:{7470 + rank}",
        labels={"run": "r1", "rank": str(rank), "node": "n1", "local_rank": str(rank)},
        filename=f"ddpmon-r1-rank{rank}.json",
    )


def test_publish_creates_dir_and_writes_file_sd_document(tmp_path: Path) -> None:
    sd_dir = tmp_path / "nested" / "sd"
    path = _publisher(sd_dir).publish()
    assert path == sd_dir / "ddpmon-r1-rank1.json"
    assert json.loads(path.read_text()) == [
        {
            "targets": ["127.0.0.1:7471"],
            "labels": {"run": "r1", "rank": "1", "node": "n1", "local_rank": "1"},
        }
    ]
    assert os.listdir(sd_dir) == ["ddpmon-r1-rank1.json"]  # no temporary file left


def test_republish_replaces_and_remove_is_idempotent(tmp_path: Path) -> None:
    pub = _publisher(tmp_path)
    pub.publish()
    pub.target = "127.0.0.1:9999"
    pub.publish()
    assert json.loads(pub.path.read_text())[0]["targets"] == ["127.0.0.1:9999"]
    pub.remove()
    assert not pub.path.exists()
    pub.remove()  # already gone: no error
    FileSDPublisher(tmp_path / "never-created", target="x:1", labels={}, filename="a.json").remove()


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    """A reader polling while the file is rewritten always parses a whole document."""
    pub = _publisher(tmp_path)
    pub.labels["padding"] = "x" * 200_000
    pub.publish()
    stop = threading.Event()
    errors: list[Exception] = []
    reads = [0]

    def read() -> None:
        while not stop.is_set():
            try:
                json.loads(pub.path.read_text())
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(50):
        pub.labels["padding"] = str(i) * 200_000
        pub.publish()
    stop.set()
    reader.join(timeout=10)
    assert errors == []
    assert reads[0] > 0, "the reader never read while the file was rewritten"


@pytest.mark.parametrize("name", ["x.yml", "../x.json", ".hidden.json"])
def test_rejects_names_prometheus_globs_would_miss(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="filename"):
        FileSDPublisher(tmp_path, target="x:1", labels={}, filename=name)
