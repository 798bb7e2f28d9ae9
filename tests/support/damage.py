"""Damaged copies of a real run dir for the readers' mutation tests.

A :class:`FileKind` is one file of a run (which rank it belongs to, its format, which readers
read it); :func:`mutations` lists bounded, seeded ways to damage it (truncation at a few
offsets, byte flips, garbage, empty, not UTF-8, another JSON shape, a future format, missing).
Each :class:`Mutation` says whether a reader of the file can tell (``expect``): ``True`` a
warning must name it, ``None`` it may or may not (a flipped byte inside a number is still a
valid number), ``False`` nothing is wrong to report (a file that is absent).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.demo import DemoRun


@dataclass(frozen=True, slots=True)
class FileKind:
    path: str
    """Relative to the run dir."""
    fmt: str
    """``json``, ``jsonl``, ``arrow``, ``text`` or ``binary``."""
    rank: int | None
    """The rank the file belongs to; None for a run-level file."""
    readers: frozenset[str]
    """Readers that read it: ``timeline``, ``compare``, ``report``, ``manifest``."""


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    damage: Callable[[bytes], bytes | None]
    """New bytes of the file from its original ones; None: the file is removed."""
    expect: Callable[[bytes], bool | None]
    """From the original bytes: must a reader name the file (True), may it (None), or is
    nothing wrong (False)?"""


def crashed_run(workdir: Path, run_id: str = "crashed") -> Path:
    """A real 2-rank ``ddpmon demo`` run dir with every kind of file, the same on every
    machine whatever its load: a NaN on rank 1 at step 4 (evidence), checkpoints every 8 steps,
    rank 1 closing cleanly at step 25 (summary, sealed history) while rank 0 waits there, then
    rank 0 killed by SIGSEGV (crash dump, history journal).

    Rank 1 closes before the crash, on purpose: had rank 0 crashed first, torchrun would
    SIGTERM rank 1 half a second later, and under load that lands before rank 1's own close
    (no summary, an unsealed history), which is a real run's outcome too but not the one these
    tests need. So the SIGSEGV is sent once rank 1's summary is on disk."""
    demo = DemoRun(
        workdir=workdir, sd_dir=workdir / "sd", steps=30, step_delay=0.05, run_id=run_id,
        injects=["nan@rank1:step4", "hang@rank0:step25", "exit@rank1:step25:code=0"],
        linger=0, extra=["--global-batch", "8", "--seed", "0", "--checkpoint-every", "8"],
    )
    with demo:
        deadline = time.monotonic() + 180
        while not (demo.run_path / "summary.rank1.json").exists():
            demo.track()
            if time.monotonic() > deadline or demo.proc.poll() is not None:
                raise AssertionError(f"rank 1 never closed: {demo.log_tail()}")
            time.sleep(0.1)
        while (demo.progress_step(0) or 0) < 24 or 0 not in demo.rank_pids():
            if time.monotonic() > deadline:
                raise AssertionError(f"rank 0 never reached step 25: {demo.log_tail()}")
            time.sleep(0.1)
        os.kill(demo.rank_pids()[0], signal.SIGSEGV)
        code = demo.wait(timeout=120)
    assert code != 0, demo.log_tail()
    crash = (demo.run_path / "crash.rank0.txt").read_text(errors="replace")
    assert "Segmentation fault" in crash, f"no SIGSEGV dump of rank 0: {demo.log_tail()}"
    return demo.run_path


def copy_run(src: Path, dst: Path) -> Path:
    """A copy that shares the unchanged files' data (hard links): the mutated file is always
    replaced, never written in place, so the original stays intact."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def apply(run: Path, kind: FileKind, mutation: Mutation) -> None:
    path = run / kind.path
    original = path.read_bytes()
    new = mutation.damage(original)
    path.unlink()
    if new is not None:
        path.write_bytes(new)


def mutations(kind: FileKind, seed: int = 0, offsets: int = 4, flips: int = 2) -> list[Mutation]:
    """Bounded damage of one file kind: ``offsets`` truncations and ``flips`` byte flips at
    seeded positions (fractions of the size), and one each of the other kinds that apply."""
    rng = random.Random(f"{kind.path}:{seed}")
    out: list[Mutation] = []
    for frac in sorted(round(rng.uniform(0.02, 0.98), 3) for _ in range(offsets)):
        out.append(Mutation(f"truncate@{frac}", _truncate(frac), _truncation_expect(kind, frac)))
    for _ in range(flips):
        frac, xor = round(rng.random(), 3), rng.randrange(1, 256)
        out.append(Mutation(f"flip@{frac}^{xor}", _flip(frac, xor), lambda raw: None))
    garbage = b"\xff\xfe" + rng.randbytes(300)
    text_kind = kind.fmt == "text"
    out += [
        Mutation("empty", lambda raw: b"", lambda raw: bool(raw) and not text_kind
                 and kind.fmt != "binary"),
        Mutation("garbage", lambda raw: garbage, lambda raw: kind.fmt != "binary"),
        Mutation("not-utf8", _insert_middle(b"\xff\xfe\xfd"),
                 lambda raw: None if kind.fmt in ("arrow", "binary") else True),
        Mutation("missing", lambda raw: None, lambda raw: False),
    ]
    if kind.fmt in ("json", "jsonl", "arrow"):
        other = b'["a", 1]\n' if kind.fmt != "jsonl" else b'[1, 2]\n"x"\n'
        out.append(Mutation("wrong-type", lambda raw: other, lambda raw: True))
    if kind.fmt == "json" and kind.path == "manifest.json":
        out.append(Mutation("future-version", _json_field("schema", 99), lambda raw: True))
    if kind.fmt == "arrow":
        out.append(Mutation("future-version", _arrow_format("99"), lambda raw: True))
    return out


def _truncate(frac: float) -> Callable[[bytes], bytes]:
    return lambda raw: raw[: max(1, int(len(raw) * frac))]


def _truncation_expect(kind: FileKind, frac: float) -> Callable[[bytes], bool | None]:
    def expect(raw: bytes) -> bool | None:
        cut = raw[: max(1, int(len(raw) * frac))]
        if kind.fmt == "json":
            return cut.strip() != raw.strip()
        if kind.fmt == "jsonl":  # only a torn last line is visible; a cut between lines is not
            last = cut.split(b"\n")[-1]
            return bool(last.strip()) and not _parses(last)
        if kind.fmt == "text":
            return None
        if kind.fmt == "arrow":
            return None  # a cut at a message boundary loses nothing: checked by rows instead
        return False

    return expect


def _parses(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _flip(frac: float, xor: int) -> Callable[[bytes], bytes]:
    def damage(raw: bytes) -> bytes:
        if not raw:
            return raw
        b = bytearray(raw)
        i = min(len(b) - 1, int(len(b) * frac))
        b[i] ^= xor
        return bytes(b)

    return damage


def _insert_middle(junk: bytes) -> Callable[[bytes], bytes]:
    return lambda raw: raw[: len(raw) // 2] + junk + raw[len(raw) // 2:]


def _json_field(key: str, value: object) -> Callable[[bytes], bytes]:
    def damage(raw: bytes) -> bytes:
        data = json.loads(raw)
        data[key] = value
        return json.dumps(data).encode()

    return damage


def _arrow_format(version: str) -> Callable[[bytes], bytes]:
    """The same rows under a schema whose ``ddpmon.history`` names another format."""

    def damage(raw: bytes) -> bytes:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        reader = ipc.open_stream(pa.py_buffer(raw))
        batches = []
        try:
            for batch in reader:
                batches.append(batch)
        except pa.ArrowInvalid:
            pass  # a journal left by a crash may end torn: keep its complete batches
        table = pa.Table.from_batches(batches, schema=reader.schema)
        meta = {**(table.schema.metadata or {}), b"ddpmon.history": version.encode()}
        table = table.replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return sink.getvalue().to_pybytes()

    return damage
