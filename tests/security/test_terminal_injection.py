"""Escape sequences and rich markup from a hostile run dir, job record or scrape never reach
the operator's terminal raw: ``timeline``, ``manifest``, ``compare``, ``jobs`` and ``top``
print them spelled out (``\\x1b``), and ``[/x]`` in a name is printed, never a MarkupError."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from ddpmon.cli import main
from ddpmon.commands import jobs, top
from ddpmon.terminal import SafeConsole, clean, shown

OSC52 = "\x1b]52;c;Y3VybCBldmlsfHNo\x07"  # writes the clipboard
CLEAR = "\x1b[2J\x1b[H"
LINK = "\x1b]8;;http://evil.example\x1b\\innocent\x1b]8;;\x1b\\"
BIDI = "\u202egnp.exe"
HOSTILE = f"layers.0{OSC52}{CLEAR}{LINK}{BIDI}[/x][bold]"


def raw_controls(text: str) -> list[str]:
    """Control characters in ``text`` other than newline, and other than the SGR colour codes
    a console writes itself (ESC [ ... m)."""
    import re

    stripped = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [c for c in stripped if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f
            or c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"]


def test_clean_and_shown_spell_every_control_out():
    assert clean("a\x1b]52;c;x\x07b") == "a\\x1b]52;c;x\\x07b"
    assert clean("\u202e\x9b\x7f") == "\\u202e\\x9b\\x7f"
    assert clean("two\nlines\tok") == "two\nlines\tok"
    assert shown("[/x] a\nb") == "\\[/x] a\\nb"
    assert raw_controls(shown(HOSTILE)) == []


def test_the_console_cleans_what_a_call_site_forgot_and_keeps_its_colours():
    buf = io.StringIO()
    console = SafeConsole(file=buf, force_terminal=True, width=120, highlight=False)
    console.print("[bold red]styled[/bold red] " + HOSTILE.replace("[", "("))  # no markup left
    console.print(HOSTILE)  # invalid markup: printed as written, no MarkupError
    out = buf.getvalue()
    assert raw_controls(out) == [], out
    assert "\x1b[1;31m" in out, "the console's own styles must survive"
    assert "[/x]" in out


def hostile_run(tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    events = [
        {"ts": 1000.0, "rank": 0, "step": None, "kind": "start", "clock_offset_seconds": 0.0,
         "world_size": 1, "host": f"node{OSC52}"},
        {"ts": 1001.0, "rank": 0, "step": 3, "kind": "nonfinite", "param": HOSTILE,
         "nonfinite": "nan", "origin": True, "message": CLEAR},
        {"ts": 1002.0, "rank": 0, "step": 3, "kind": "exit", "reason": "exception", "code": 1,
         "exc_type": f"Error{LINK}", "message": HOSTILE},
    ]
    (run / "events.rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "manifest.json").write_text(json.dumps({"schema": 1, "host": HOSTILE}))
    return run


@pytest.mark.parametrize("argv", [["timeline"], ["timeline", "--steps"], ["manifest"]])
def test_readers_print_a_hostile_run_dir_escaped(tmp_path, capsys, argv):
    run = hostile_run(tmp_path)
    main([*argv, str(run)])
    out = capsys.readouterr()
    assert raw_controls(out.out) == [], out.out
    assert raw_controls(out.err) == [], out.err
    assert "MarkupError" not in out.err
    if argv[0] == "timeline":
        assert "layers.0" in out.out and "\\x1b]52" in out.out  # shown, spelled out


def test_jobs_status_of_a_hostile_record(tmp_path):
    """With a plain rich Console: the call sites escape, not only the safety net."""
    buf = io.StringIO()
    console = Console(file=buf, width=160)
    job = {"id": "j1", "state": "FAILED", "reason": HOSTILE, "entrypoint": "demo", "nproc": 2,
           "args": [OSC52, "[/x]"], "created_at": 1.0, "started_at": 2.0, "ended_at": 3.0,
           "ports": [7500], "run_path": f"/runs/{CLEAR}", "job_dir": "/j",
           "first_failure": {"rank": 1, "kind": HOSTILE, "source": "event_log", "step": 3},
           "ranks": {"0": {"note": LINK}}, "summary": {"ranks": {"0": {"step": BIDI}}}}
    jobs._print_job(console, job)
    console.print(jobs._list_table([job]))
    out = buf.getvalue()
    assert raw_controls(out) == [], out
    assert "[/x]" in out


def test_top_shows_a_hostile_target_escaped():
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    console.print(top._table({f"127.0.0.1:1{OSC52}[/x]": None}, {}, 1.0))
    out = buf.getvalue()
    assert raw_controls(out) == [], out
    assert "down" in out
