"""History files written by a hostile run dir: ``report`` and ``compare`` read them in bounded
memory and time, name the damage, and still use the rows and the other ranks.

- a 3 GB sparse ``history.rank1.arrow`` (a real stream, then holes) is read up to
  ``MAX_HISTORY_BYTES``, in chunks, under an address-space limit below the file's size;
- 16 MB of zero bytes (each 4 of them an end-of-stream marker) are skipped in one pass;
- a record batch that would decode past ``MAX_HISTORY_DECODED_BYTES`` is not decompressed;
- a module group named ``a${$`` or a ``--compare`` directory named ``b$^^$`` is drawn as
  written, never parsed as mathtext; one named ``_base`` keeps its legend entry;
- ``groups`` schema metadata nested 100,000 deep, or ``[1, 2]``, is damage, not a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

from ddpmon.cli import main  # noqa: E402
from ddpmon.recorder import arrow_frames, history_read  # noqa: E402
from ddpmon.recorder.arrow_frames import MAX_HISTORY_BYTES, marker_run  # noqa: E402
from ddpmon.rundir.damage import ReadWarnings  # noqa: E402
from tests.support.histories import history_bytes, history_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 2560 << 20
"""The issue's limit, below the 3 GB file: reading it whole raised MemoryError."""
LIMIT = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({AS_LIMIT}, {AS_LIMIT}))
from ddpmon.cli import main
code = main(sys.argv[1:])
print("peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MB",
      file=sys.stderr)
sys.exit(code)
"""


def limited(*argv: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", LIMIT, *argv], cwd=REPO, capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )
    peak = [ln for ln in done.stderr.splitlines() if ln.startswith("peak RSS")]
    print(f"{argv[0]}: {time.monotonic() - t0:.2f} s, {peak}")
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr
    return done


@pytest.fixture
def sparse_runs(tmp_path) -> tuple[Path, Path]:
    base = history_run(tmp_path, "base")
    hostile = history_run(tmp_path, "hostile")
    with open(hostile / "history.rank1.arrow", "ab") as fh:
        fh.truncate(3 << 30)  # holes: no disk, but 3 GB to a reader that reads it whole
    return base, hostile


DAMAGE = f"history.rank1.arrow: over {MAX_HISTORY_BYTES} bytes ({3 << 30} bytes); using the " \
    "20 rows before it"


def test_report_reads_a_3gb_sparse_history_in_bounded_memory(sparse_runs, tmp_path):
    base, hostile = sparse_runs
    out = tmp_path / "report.html"
    done = limited("report", str(hostile), "--compare", str(base), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert DAMAGE in done.stderr, done.stderr
    assert "2 of 2 ranks, 20 steps" in done.stdout  # rank 1's rows before the holes are used
    assert f"over {MAX_HISTORY_BYTES} bytes" in out.read_text()


def test_compare_reads_a_3gb_sparse_history_in_bounded_memory(sparse_runs):
    base, hostile = sparse_runs
    done = limited("compare", "--json", str(base), str(hostile))
    assert done.returncode in (0, 1), done.stderr  # 1: the runs differ (they do not here)
    assert DAMAGE in done.stderr, done.stderr


def test_zero_bytes_are_skipped_in_one_pass(tmp_path, monkeypatch):
    """16 MB of zeros after a stream are 4 million legacy end-of-stream markers: one chunked
    pass (a handful of reads), where the reader used to turn once per marker (29 s of CPU)."""
    path = tmp_path / "history.rank1.arrow"
    path.write_bytes(history_bytes(20, rank=1) + b"\0" * (16 << 20) + history_bytes(5, rank=1))
    reads = []
    real = arrow_frames.Frames._read

    def counted(self, pos, n):
        reads.append(n)
        return real(self, pos, n)

    monkeypatch.setattr(arrow_frames.Frames, "_read", counted)
    damage = ReadWarnings()
    h = history_read.load_history(path, 1, damage)
    assert h is not None and len(h) == 20 and not damage.items  # the second stream's 5 too
    assert len(reads) < 40, len(reads)


def test_marker_runs_end_where_a_message_starts():
    eos, legacy = b"\xff\xff\xff\xff\0\0\0\0", b"\0\0\0\0"
    message = b"\xff\xff\xff\xff\x10\0\0\0"
    assert marker_run(eos * 3 + legacy + message) == 28
    assert marker_run(legacy + b"\xff\xff\xff\xff") == 4  # the next chunk decides
    assert marker_run(message) == 0 and marker_run(b"") == 0


def test_a_batch_that_would_decode_past_the_cap_is_not_decompressed(tmp_path, monkeypatch):
    """The decoded size is known from the buffers' own length prefixes before pyarrow
    decompresses a byte: 20,000 rows compress to a few KB and decode to about 2 MB."""
    path = tmp_path / "history.rank0.arrow"
    path.write_bytes(history_bytes(20) + history_bytes(20_000))
    size = os.path.getsize(path)
    assert size < (1 << 20)  # decodes to more than the file holds
    monkeypatch.setattr(history_read, "MAX_HISTORY_DECODED_BYTES", 1 << 20)
    damage = ReadWarnings()
    h = history_read.load_history(path, 0, damage)
    assert h is not None and len(h) == 20
    assert damage.lines() == [f"{path}: its batches decode to over {1 << 20} bytes; using the "
                              "20 rows before it"]


def test_mathtext_in_names_is_drawn_as_written(tmp_path, capsys):
    run = history_run(tmp_path, "a${$")
    base = history_run(tmp_path, "b$^^$")
    for rank in (0, 1):
        (run / f"history.rank{rank}.arrow").write_bytes(
            history_bytes(20, groups=("a${$", "x$^^$", "ok"), rank=rank))
    out = tmp_path / "report.html"
    assert main(["report", str(run), "--compare", str(base), "-o", str(out)]) == 0
    html = out.read_text()
    assert "a${$" in html and "x$^^$" in html and "b$^^$ loss rank 0" in html


def test_a_name_that_starts_with_an_underscore_stays_in_the_legend(tmp_path):
    """matplotlib leaves a label that starts with ``_`` out of the legend: a ``--compare`` run
    ``_base`` (or a group ``_backbone``) would have no legend entry."""
    run = history_run(tmp_path, "run")
    base = history_run(tmp_path, "_base")
    for rank in (0, 1):
        (run / f"history.rank{rank}.arrow").write_bytes(
            history_bytes(20, groups=("_backbone", "ok"), rank=rank))
    out = tmp_path / "report.html"
    assert main(["report", str(run), "--compare", str(base), "-o", str(out)]) == 0
    assert "_base loss rank 0" in out.read_text()


@pytest.mark.parametrize("groups", ["[" * 100_000 + "]" * 100_000, "[1, 2]", '{"a": 1}'])
def test_hostile_groups_metadata_is_damage(tmp_path, capsys, groups):
    run = history_run(tmp_path, "run")
    base = history_run(tmp_path, "base")
    (run / "history.rank1.arrow").write_bytes(history_bytes(20, rank=1, meta={"groups": groups}))
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert "history.rank1.arrow: schema metadata groups: " in err
    assert "its group norms named by position" in err
    assert main(["compare", "--json", str(base), str(run)]) in (0, 1)
    assert "history.rank1.arrow: schema metadata groups: " in capsys.readouterr().err


def test_a_declared_decoded_size_is_checked_before_decompressing(tmp_path):
    """A compressed buffer whose length prefix claims 1 TB: refused from the claim, with no
    allocation (pyarrow would allocate what the prefix says before decompressing)."""
    path = tmp_path / "history.rank0.arrow"
    bomb = bytearray(history_bytes(20))
    at = bomb.find((160).to_bytes(8, "little"))  # the 20 steps' int64 buffer, decoded
    assert at > 0
    bomb[at:at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(history_bytes(20) + bytes(bomb))
    damage = ReadWarnings()
    h = history_read.load_history(path, 0, damage)
    assert h is not None and len(h) == 20
    assert damage.lines() == [f"{path}: its batches decode to over "
                              f"{history_read.MAX_HISTORY_DECODED_BYTES} bytes; using the 20 "
                              "rows before it"]


@pytest.mark.parametrize("claim", ["metadata", "body"])
def test_lengths_a_file_claims_are_checked_before_reading(tmp_path, claim):
    """A message that claims 2 GB of metadata, or a body of 1 TB, in a file of a few KB: the
    read stops there as torn (the rows before it kept), nothing of that size is allocated."""
    good = history_bytes(20)
    if claim == "metadata":
        tail = b"\xff\xff\xff\xff" + (2**31 - 1).to_bytes(4, "little") + b"\0" * 64
    else:  # a real message whose bodyLength field (an int64 in its flatbuffer) is raised
        second = bytearray(history_bytes(20))
        body = _body_length_offset(second)
        second[body:body + 8] = (1 << 40).to_bytes(8, "little")
        tail = bytes(second)
    path = tmp_path / "history.rank0.arrow"
    path.write_bytes(good + tail)
    damage = ReadWarnings()
    h = history_read.load_history(path, 0, damage)
    assert h is not None and len(h) == 20
    assert len(damage.items) == 1 and "truncated after 20" in damage.lines()[0]


def _body_length_offset(stream: bytearray) -> int:
    """Where the bodyLength of the stream's second message (its record batch) lies."""
    from ddpmon.recorder.arrow_frames import _field, _u32

    schema_len = int.from_bytes(stream[4:8], "little")
    at = 8 + schema_len  # the record batch message: continuation, length, flatbuffer
    meta = bytes(stream[at + 8:at + 8 + int.from_bytes(stream[at + 4:at + 8], "little")])
    field = _field(meta, _u32(meta, 0), 3)
    assert field is not None
    return at + 8 + field
