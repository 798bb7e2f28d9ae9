"""The daemon's job store (SQLite) when its file or one record in it is damaged: a clear
message naming the file or the job, never a traceback, and the readable records still served."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.daemon.store import JobRecord, Store, StoreError


def filled(path: Path, jobs: int = 60) -> Path:
    store = Store(path)
    for i in range(jobs):  # several pages, so a cut lands inside the data
        store.insert_job(JobRecord(id=f"j{i}", entrypoint="demo", nproc=2,
                                   args=["--steps", str(i)] * 20))
    store.close()
    return path


@pytest.mark.parametrize("damage", ["garbage", "empty-header", "truncated"])
def test_a_damaged_store_file_is_named_with_what_to_do(tmp_path, damage):
    path = filled(tmp_path / "ddpmon.sqlite3")
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(random.Random(0).randbytes(8192))
    elif damage == "empty-header":
        path.write_bytes(b"\0" * 100 + raw[100:])
    else:
        path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(StoreError) as err:
        Store(path)
    assert str(path) in str(err.value) and "move it aside" in str(err.value)


def test_an_unreadable_record_is_skipped_in_lists_and_named_when_asked_for(tmp_path, caplog):
    path = filled(tmp_path / "ddpmon.sqlite3", jobs=3)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET doc = ? WHERE id = 'j1'", ('{"id": "j1", "entr',))
        db.execute("UPDATE jobs SET doc = ? WHERE id = 'j2'", ("[1, 2]",))
        db.execute("INSERT INTO ranks (run, rank, doc) VALUES ('r', 0, 'not json')")
    store = Store(path)
    assert [j.id for j in store.list_jobs()] == ["j0"]  # the readable one still listed
    assert "unreadable job record skipped" in caplog.text
    assert store.get_job("j0") is not None and store.get_job("nope") is None
    for bad in ("j1", "j2"):  # damaged, never reported as missing
        with pytest.raises(StoreError, match=f"job '{bad}': unreadable record"):
            store.get_job(bad)
    assert list(store.iter_ranks()) == []
    store.close()


def test_the_daemon_refuses_a_damaged_store_with_a_message(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "ddpmon.sqlite3").write_bytes(b"this is not a database" * 100)
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "daemon", "--state-dir", str(state), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"ddpmon daemon: {state / 'ddpmon.sqlite3'}: not a usable SQLite database" in (
        proc.stderr), proc.stderr
