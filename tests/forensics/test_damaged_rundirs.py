"""Every reader on damaged copies of one real crashed run (2 ranks, gloo, a NaN on rank 1 at
step 4, checkpoints every 8 steps, rank 1 closed at step 25, then rank 0 killed by SIGSEGV;
``damage.crashed_run``): truncated at seeded offsets, bytes flipped, garbage, empty, not UTF-8,
another JSON shape, a future format, missing.

For each case: no traceback (the CLI runs in-process, so any exception fails the test), the
damaged file named when a reader can tell, never reported for a file that is merely absent, and
every undamaged rank still used. Bounded: 4 offsets and 2 flips per file, seeded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.cli import main
from tests.support import damage
from tests.support.damage import FileKind, Mutation, apply, copy_run, mutations

pytest.importorskip("pyarrow")

T, C, R, M = "timeline", "compare", "report", "manifest"
KINDS = (
    FileKind("events.rank0.jsonl", "jsonl", 0, frozenset({T, C, R})),
    FileKind("progress.rank0.json", "json", 0, frozenset({T, R})),
    # the timeline reads the histories too: goodput's step rows, the stragglers' step parts
    FileKind("history.rank1.arrow", "arrow", 1, frozenset({T, C, R})),
    FileKind("history.rank0.tail.arrow", "arrow", 0, frozenset({T, C, R})),
    FileKind("crash.rank0.txt", "text", 0, frozenset({T, R})),
    FileKind("sigterm.rank0.txt", "text", 0, frozenset({T, R})),
    FileKind("manifest.json", "json", None, frozenset({C, R, M})),
    FileKind("annotations.json", "json", None, frozenset({C, R})),
    FileKind("summary.rank1.json", "json", 1, frozenset()),
    FileKind("evidence/rank1-step4-nonfinite/info.json", "json", 1, frozenset()),
    FileKind("checkpoints/step-000008.pt", "binary", None, frozenset()),
)
CASES = [(k, m) for k in KINDS for m in mutations(k)]
REPORTED = ("garbage",)
"""Mutations the (slower, plotting) report runs on; the other readers run on every case."""


@pytest.fixture(scope="session")
def crashed_run(tmp_path_factory) -> Path:
    run = damage.crashed_run(tmp_path_factory.mktemp("damaged"))
    for kind in KINDS:
        assert (run / kind.path).exists(), f"the demo no longer leaves {kind.path}"
    return run


@pytest.fixture(scope="session")
def pristine(crashed_run, tmp_path_factory):
    """What the readers say of the undamaged run: the baseline each case is held to."""
    tl = _json_of("timeline", str(crashed_run), "--json")
    return {"events": {int(r): v["events"] for r, v in tl["ranks"].items()}}


def _json_of(*argv: str) -> dict:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    doc = json.loads(out.getvalue())
    doc["_code"], doc["_err"] = code, err.getvalue()
    return doc


@pytest.mark.parametrize(("kind", "mutation"), CASES,
                         ids=[f"{k.path.split('/')[-1]}-{m.name}" for k, m in CASES])
def test_readers_hold_against_damage(kind: FileKind, mutation: Mutation, crashed_run, pristine,
                                     tmp_path, capsys):
    original = (crashed_run / kind.path).read_bytes()
    expect = mutation.expect(original)
    run = copy_run(crashed_run, tmp_path / "run")
    apply(run, kind, mutation)
    others = [r for r in (0, 1) if r != kind.rank]
    name = kind.path

    tl = _json_of(T, str(run), "--json")
    assert tl["_code"] in (0, 3), tl
    for r in others:  # every undamaged rank keeps all its events
        assert tl["ranks"][str(r)]["events"] == pristine["events"][r], tl["ranks"]
    _check_named(T, kind, expect, [d["file"] for d in tl["damaged"]], tl["warnings"], tl["_err"])

    cmp = _json_of(C, str(crashed_run), str(run), "--json")
    assert cmp["_code"] in (0, 1, 3), cmp
    used = cmp["basis"]["b"]["ranks"]
    assert set(others) <= set(used), cmp["basis"]
    assert cmp["basis"]["b"]["ranks_expected"] == 2
    if len(used) < 2:  # fewer ranks than the run had: said, never silent
        assert any(f"rests on {len(used)} of 2 ranks" in w for w in cmp["warnings"]), cmp
    damaged_b = [d["file"] for d in cmp["damaged"] if d["run"] == "b"]
    _check_named(C, kind, expect, damaged_b, cmp["warnings"], cmp["_err"], prefix="run B: ")

    code = main([M, str(run), "--check"])
    err = capsys.readouterr().err
    warned = f"ddpmon manifest: warning: {name}:" in err
    if M in kind.readers and mutation.name == "missing":
        assert code == 2 and "does not exist" in err
    elif M not in kind.readers or expect is False:
        assert not warned and code in (0, 1), err
    else:
        assert warned or not expect, err
        if warned and mutation.name != "future-version":
            assert code == 2, err  # unreadable: exit 2
        else:
            assert code in (0, 1), err  # readable, or a newer schema that is still checked

    if mutation.name in REPORTED and R in kind.readers:
        out_html = tmp_path / "report.html"
        code = main([R, str(run), "-o", str(out_html)])
        out, err = capsys.readouterr()
        assert code == 0 and out_html.stat().st_size > 10_000, err
        m = re.search(r"rest on (\d+) of (\d+) ranks, (\d+) steps[^\n]*\(ranks \[([\d, ]*)\]\)",
                      out)
        assert m, out
        assert set(others) <= {int(x) for x in m.group(4).split(",") if x.strip()}, out
        assert (f"ddpmon report: warning: {name}:" in err) == bool(expect), err


def _check_named(reader: str, kind: FileKind, expect: bool | None, damaged: list[str],
                 warnings: list[str], err: str, prefix: str = "") -> None:
    """The damaged file is named (in ``damaged``, ``warnings`` and on stderr) when the reader
    reads it and can tell; never when nothing is wrong with it (absent) or it does not read it."""
    named = kind.path in damaged
    if reader not in kind.readers or expect is False:
        assert not named, (reader, damaged)
        return
    if expect is None:
        return
    assert named, (reader, kind.path, damaged, warnings)
    assert any(w.startswith(f"{prefix}{kind.path}: ") for w in warnings), warnings
    assert f"ddpmon {reader}: warning: {prefix}{kind.path}: " in err, err


def test_the_cases_are_bounded():
    assert len(CASES) <= 12 * len(KINDS)
    assert len({(k.path, m.name) for k, m in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "named"), [
    (("timeline", "{run}"), "events.rank0.jsonl"),
    (("compare", "{src}", "{run}"), "history.rank1.arrow"),
    (("manifest", "{run}", "--check"), "manifest.json"),
])
def test_no_traceback_from_the_real_command(argv, named, crashed_run, tmp_path):
    """The installed command, as a user runs it, on a run with every file kind damaged."""
    run = copy_run(crashed_run, tmp_path / "run")
    for kind in KINDS:
        apply(run, kind, next(m for m in mutations(kind) if m.name == "garbage"))
    args = [a.format(run=run, src=crashed_run) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", *args], capture_output=True,
                          text=True, timeout=120)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode in (0, 1, 2, 3), proc.stderr
    assert named in proc.stderr, proc.stderr


@pytest.mark.parametrize(("content", "problem"), [
    (b'{"pg_status": {"0": {"last_enqueued', "truncated JSON"),
    (b'{"version": "2.10"}', "no pg_status object"),
    (b"\x80\x04garbage", "not UTF-8"),
])
def test_a_damaged_flight_recorder_dump_is_named(content, problem, crashed_run, tmp_path):
    """The demo leaves no dump without a hang, so this one is written beside the real run."""
    run = copy_run(crashed_run, tmp_path / "run")
    dump = run / "flight_recorder" / "fr_trace_rank_0.json"
    dump.parent.mkdir()
    dump.write_bytes(content)
    tl = _json_of(T, str(run), "--json")
    (d,) = [d for d in tl["damaged"] if d["file"] == "flight_recorder/fr_trace_rank_0.json"]
    assert problem in d["problem"] and d["kept"] == "its collective counts not used"
    assert "flight_recorder" not in tl["ranks"]["0"]


def test_when_nothing_is_readable_the_json_error_still_names_each_file(crashed_run, tmp_path):
    run = copy_run(crashed_run, tmp_path / "run")
    rank1_events = FileKind("events.rank1.jsonl", "jsonl", 1, frozenset({T, C, R}))
    for kind in (*KINDS, rank1_events):
        apply(run, kind, next(m for m in mutations(kind) if m.name == "garbage"))
    tl = _json_of(T, str(run), "--json")
    assert tl["_code"] == 2 and "no readable events" in tl["error"]
    assert {"events.rank0.jsonl", "events.rank1.jsonl"} <= {d["file"] for d in tl["damaged"]}
    assert len(tl["warnings"]) == len(tl["damaged"])
    cmp = _json_of(C, str(crashed_run), str(run), "--json")
    assert cmp["_code"] == 2 and "no usable numerics history" in cmp["error"]
    assert {(d["run"], d["file"]) for d in cmp["damaged"]} >= {
        ("b", "history.rank1.arrow"), ("b", "history.rank0.tail.arrow")}
    assert any(w.startswith("run B: history.rank1.arrow: ") for w in cmp["warnings"])
