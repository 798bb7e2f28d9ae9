"""Numerics history: round trip, SIGKILL up to the last flush, torn files, bounds, the agent's
sink and ``Monitor.annotate``."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest

pytest.importorskip("pyarrow")

from ddpmon.metrics.state import StepRecord  # noqa: E402
from ddpmon.recorder.history import (  # noqa: E402
    Downsampler,
    HistoryWriter,
    journal_path,
    row_of,
)
from ddpmon.recorder.history_read import read_history  # noqa: E402

GROUPS = ("embed", "encoder", "head")


def record(step: int, **kw) -> StepRecord:
    base = dict(
        step=step,
        wall_time=1000.0 + step,
        duration_seconds=0.01,
        data_wait_seconds=0.001,
        loss=2.0 - step * 1e-3,
        grad_norm=1.0 + step,
        grad_local_norm=0.5 + step,
        group_norms={"embed": 0.1 * step, "encoder": 0.2 * step, "head": 0.3 * step},
        loss_scale=65536.0,
        collective_seconds={"all_reduce": [0.001], "reduce_scatter": [0.003]},
    )
    base.update(kw)
    return StepRecord(**base)


def test_round_trip_keeps_every_column(tmp_path):
    path = tmp_path / "history.rank3.arrow"
    w = HistoryWriter(path, GROUPS, meta={"rank": "3"}, flush_seconds=0.05)
    w.put(row_of(record(0), GROUPS, 123))
    w.put(row_of(record(1, loss=float("nan"), origin=True, local_nonfinite=True,
                        skipped_by="scaler", amp_skipped=True), GROUPS, None))
    w.put(row_of(record(2, group_norms={"embed": 1.5}), GROUPS, 456))
    w.close()
    assert not journal_path(path).exists()  # sealed and removed at close
    h = read_history(path)
    assert h.rank == 3 and h.groups == list(GROUPS) and len(h) == 3
    c = h.columns
    assert list(c["step"]) == [0, 1, 2]
    assert c["grad_norm"][2] == pytest.approx(3.0)
    assert math.isnan(c["loss"][1]) and c["origin"][1] and not c["origin"][0]
    assert list(c["skipped_by"]) == [0, 1, 0] and c["amp_skipped"][1]
    assert c["collective_count"][0] == 2  # every op of the step
    assert c["collective_mean_seconds"][0] == pytest.approx(0.002)
    assert c["collective_max_seconds"][0] == pytest.approx(0.003)
    assert c["memory_bytes"][0] == 123 and c["memory_bytes"][2] == 456
    assert h.group("head")[1] == pytest.approx(0.3)
    assert h.group("embed")[2] == pytest.approx(1.5) and math.isnan(h.group("head")[2])


def test_files_with_the_old_allreduce_columns_still_read(tmp_path):
    """Files written before the collective_* rename name the columns allreduce_*."""
    import pyarrow as pa

    from ddpmon.recorder.history_schema import OLD_NAMES

    path = tmp_path / "history.rank0.arrow"
    w = HistoryWriter(path, GROUPS, meta={"rank": "0"}, flush_seconds=0.05)
    w.put(row_of(record(0), GROUPS, 1))
    w.close()
    with pa.ipc.open_stream(path) as reader:
        table = reader.read_all()
    old = table.rename_columns([OLD_NAMES.get(n, n) for n in table.column_names])
    old = old.replace_schema_metadata(table.schema.metadata)
    assert "allreduce_count" in old.column_names and "collective_count" not in old.column_names
    with pa.ipc.new_stream(path, old.schema) as writer:
        writer.write_table(old)
    c = read_history(path).columns
    assert c["collective_count"][0] == 2
    assert c["collective_max_seconds"][0] == pytest.approx(0.003)


def test_sigkill_loses_at_most_the_last_flush(tmp_path, procs):
    path = tmp_path / "history.rank0.arrow"
    child = procs.start(
        """
        import sys, time
        from pathlib import Path
        from ddpmon.recorder.history import HistoryWriter, journal_path, row_of
        from ddpmon.recorder.history_read import read_history
        from ddpmon.metrics.state import StepRecord
        groups = ("a", "b")
        w = HistoryWriter(sys.argv[1], groups, flush_seconds=0.2, seal_rows=300)
        def rec(s):
            return StepRecord(step=s, wall_time=float(s), duration_seconds=0.0,
                              data_wait_seconds=0.0, grad_norm=float(s),
                              group_norms={"a": 1.0, "b": 2.0})
        def on_disk(rows, journal=False):  # a fixed sleep raced the flush on a busy machine
            deadline = time.monotonic() + 60
            while True:
                try:
                    if len(read_history(sys.argv[1])) >= rows and (
                        journal_path(Path(sys.argv[1])).exists() or not journal
                    ):
                        return
                except Exception:   # not written yet, or caught mid-write
                    pass
                assert time.monotonic() < deadline, f"{rows} rows not flushed"
                time.sleep(0.05)
        for s in range(1000):       # drained at once: sealed into the main file
            w.put(row_of(rec(s), groups, None))
        on_disk(1000)               # sealed and on disk now
        for s in range(1000, 1100): # fewer than seal_rows: into the journal
            w.put(row_of(rec(s), groups, None))
        on_disk(1100, journal=True) # journaled now
        print("flushed", flush=True)
        s = 1100
        while True:                 # keep writing until killed
            w.put(row_of(rec(s), groups, None)); s += 1; time.sleep(0.01)
        """,
        str(path),
    )
    assert child.stdout.readline().strip() == "flushed", child.stderr.read()
    time.sleep(0.3)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert journal_path(path).exists()  # killed: the journal holds the unsealed rows
    h = read_history(path)
    steps = list(h.columns["step"])
    assert steps[:1100] == list(range(1100))  # nothing before the last flush is lost
    assert steps == list(range(len(steps)))  # no gap, no duplicate (journal merged)
    assert list(h.columns["grad_norm"][:1000]) == [float(s) for s in range(1000)]

    # a restarted attempt of the same run appends after what the killed one left
    groups = ("a", "b")
    w = HistoryWriter(path, groups, flush_seconds=0.05)
    for s in (5, 6, 100_000):  # steps 5-6 repeated (resumed from a checkpoint), then new ones
        w.put(row_of(StepRecord(step=s, wall_time=1.0, duration_seconds=0.0,
                                data_wait_seconds=0.0, grad_norm=-1.0,
                                group_norms={"a": 1.0, "b": 2.0}), groups, None))
    w.close()
    assert not journal_path(path).exists()
    again = read_history(path)
    assert not again.torn
    assert list(again.columns["step"]) == steps + [100_000]
    assert again.columns["grad_norm"][5] == -1.0  # the later attempt's row wins
    assert again.columns["grad_norm"][7] == 7.0


def test_torn_last_message_is_dropped_and_flagged(tmp_path):
    path = tmp_path / "history.rank0.arrow"
    w = HistoryWriter(path, GROUPS, flush_seconds=0.05, seal_rows=2)
    for s in range(6):
        w.put(row_of(record(s), GROUPS, None))
        time.sleep(0.12)  # each pair sealed as its own batch
    w.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a writer killed in the middle of its last batch
        f.truncate(size - 40)
    h = read_history(path)
    assert h.torn
    assert 2 <= len(h) < 6 and list(h.columns["step"]) == list(range(len(h)))


def test_two_attempts_append_as_two_streams(tmp_path):
    path = tmp_path / "history.rank0.arrow"
    for first in (0, 3):
        w = HistoryWriter(path, GROUPS, flush_seconds=0.05)
        for s in range(first, first + 5):
            w.put(row_of(record(s, loss=float(first)), GROUPS, None))
        w.close()
    h = read_history(path)
    assert list(h.columns["step"]) == list(range(8)) and not h.torn
    assert list(h.columns["loss"]) == [0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0, 3.0]


def test_not_a_history_is_a_clear_error(tmp_path):
    bad = tmp_path / "history.rank0.arrow"
    bad.write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        read_history(bad)
    with pytest.raises(FileNotFoundError):
        read_history(tmp_path / "history.rank9.arrow")


def test_downsampling_is_logarithmic_and_keeps_notable_steps():
    d = Downsampler(full_rows=1000, segment_rows=250, notable_max=5)
    kept = []
    for s in range(20_000):
        origin = s in (1501, 1503, 7777)
        row = row_of(record(s, origin=origin), GROUPS, None)
        if d.keep(row):
            kept.append(s)
    assert kept[:1000] == list(range(1000))  # every step of the first full_rows
    assert {1501, 1503, 7777} <= set(kept)  # notable steps survive any stride
    # 1000 full + 250 at stride 2, 4, 8, 16, 32, 64 ... : far fewer rows than steps
    assert len(kept) < 2800
    assert kept[1000:1003] == [1000, 1002, 1004]
    strides = {b - a for a, b in zip(kept[-50:], kept[-49:], strict=False)}
    assert max(strides) >= 32


def test_agent_writes_one_row_per_step_and_annotations(tmp_path):
    import torch

    import ddpmon

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, run_dir=str(tmp_path), run_id="r", port=0)
    assert mon.enabled, mon.error
    mon.annotate(global_batch=16, seed=3)
    with pytest.raises(ValueError, match="global_batch"):
        mon.annotate(global_batch=-1)
    for _ in range(5):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        mon.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    run = tmp_path / "r"
    assert json.loads((run / "annotations.json").read_text()) == {"global_batch": 16, "seed": 3}
    h = read_history(run / "history.rank0.arrow")
    assert list(h.columns["step"]) == [0, 1, 2, 3, 4]
    assert h.groups and all(g in ("0", "1") for g in h.groups)
    norms = h.columns["grad_norm"]
    assert all(n > 0 for n in norms)
    # the group norms make up the global norm
    sq = (h.columns["group_norms"] ** 2).sum(axis=1)
    assert sq == pytest.approx(norms**2, rel=1e-4)
    assert all(m > 0 for m in h.columns["memory_bytes"])  # process RSS on CPU
    assert h.memory_kind == "rss"
