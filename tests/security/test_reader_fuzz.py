"""A bounded fuzz of every reader's input: a real run dir (the agent in this process, a NaN at
step 3) mutated at random, file by file, and read by ``timeline`` (text and ``--json``),
``manifest`` (and ``--check``), ``compare`` and ``report`` as the CLI runs them. Each must end
with an exit status (never a traceback), within the time limit (a reader that blocked on a FIFO
would hit it), and print no control character raw.

The seed is fixed so that a failure reruns as it was; ``DDPMON_FUZZ_SEED`` picks another and
``DDPMON_FUZZ_SECONDS`` another budget (default 8 s, at least 4 rounds)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpmon
from ddpmon.cli import main
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(180)
SEED = int(os.environ.get("DDPMON_FUZZ_SEED", "20261204"))
BUDGET = float(os.environ.get("DDPMON_FUZZ_SECONDS", "8"))
RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
HOSTILE_TEXT = [
    "\x1b]52;c;ZWNobyBwd25lZA==\x07",  # OSC 52: write the clipboard
    "\x1b[2J\x1b[H",  # clear the screen
    "\x1b]8;;https://evil.example\x1b\\docs\x1b]8;;\x1b\\",  # a disguised link
    "\u202eexe.txt",  # bidi override
    "[/x]", "[bold red]boom[/]", "[link=file:///etc/passwd]x[/link]",
]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-seed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = ddpmon.attach(
        model, opt, port=free_port(), bind="127.0.0.1", run_dir=str(root), run_id="seed",
        linger_seconds=0,
    )
    try:
        for step in range(8):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            mon.observe_loss(loss)
            if step == 3:
                model[0].weight.register_hook(lambda g: g * float("nan"))
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        mon.close()
    run = root / "seed"
    assert sorted(p.name for p in run.iterdir() if p.is_file()), "the agent wrote no run dir"
    return run


def _hostile_value(rng: random.Random) -> object:
    return rng.choice([
        [], {"a": [1]}, None, 10**400, -1, 1e308, "", rng.choice(HOSTILE_TEXT),
        "x" * rng.randint(1, 4096), True,
    ])


def _mutate_json(data: bytes, rng: random.Random) -> bytes:
    """Change one value of one JSON line (or of the document) to another type or a hostile
    string, keeping the rest valid: the readers' assumptions about shapes are what is tried."""
    lines = data.split(b"\n")
    idx = [i for i, line in enumerate(lines) if line.strip().startswith(b"{")]
    if not idx:
        return data
    i = rng.choice(idx)
    try:
        doc = json.loads(lines[i])
    except ValueError:
        return data
    if isinstance(doc, dict) and doc:
        doc[rng.choice(sorted(doc))] = _hostile_value(rng)
    lines[i] = json.dumps(doc).encode()
    return b"\n".join(lines)


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0 and data:  # flip bytes
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        return bytes(buf)
    if kind == 1:  # truncate
        return data[: rng.randint(0, len(data))]
    if kind == 2:  # a hostile line of text among the lines
        line = json.dumps({"kind": rng.choice(HOSTILE_TEXT), "rank": 0, "ts": 1.0,
                           "param": rng.choice(HOSTILE_TEXT), "message": rng.choice(HOSTILE_TEXT)})
        return data + line.encode() + b"\n"
    if kind == 3:  # nested past the parser's recursion
        return data + b"[" * 100_000 + b"]" * 100_000 + b"\n"
    if kind == 4:  # one huge line
        return data + b'{"kind": "exit", "x": "' + b"y" * 3_000_000 + b'"}\n'
    return b""


def mutate(run: Path, rng: random.Random) -> list[str]:
    files = sorted(p for p in run.rglob("*") if p.is_file())
    done = []
    for path in rng.sample(files, k=min(len(files), rng.randint(1, 3))):
        choice = rng.randrange(10)
        if choice == 0:
            path.unlink()
            os.mkfifo(path)
            done.append(f"fifo {path.name}")
        elif choice == 1:
            path.unlink()
            path.symlink_to("/dev/zero")
            done.append(f"/dev/zero {path.name}")
        elif choice == 2:
            path.unlink()
            path.mkdir()
            done.append(f"dir {path.name}")
        elif choice <= 5:
            path.write_bytes(_mutate_json(path.read_bytes(), rng))
            done.append(f"json {path.name}")
        else:
            path.write_bytes(_mutate_bytes(path.read_bytes(), rng))
            done.append(f"bytes {path.name}")
    return done


def read_all(run: Path, seed: Path, out: Path, with_report: bool) -> list[list[str]]:
    calls = [
        ["timeline", str(run)],
        ["timeline", "--json", "--steps", str(run)],
        ["manifest", str(run)],
        ["manifest", "--check", str(run)],
        ["compare", str(seed), str(run)],
    ]
    if with_report:  # its plots take seconds: every fourth round
        calls.append(["report", str(run), "-o", str(out)])
    return calls


def test_readers_survive_a_mutated_run_dir(seed_run, tmp_path, capsys):
    rng = random.Random(SEED)
    end = time.monotonic() + BUDGET
    rounds = calls = 0
    statuses: dict[int, int] = {}
    while time.monotonic() < end or rounds < 4:
        run = tmp_path / f"r{rounds}"
        shutil.copytree(seed_run, run, symlinks=True)
        what = mutate(run, rng)
        for argv in read_all(run, seed_run, tmp_path / f"r{rounds}.html", rounds % 4 == 0):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse and the like: still a status
                code = exc.code if isinstance(exc.code, int) else 2
            except BaseException as exc:
                pytest.fail(f"seed {SEED} round {rounds} ({what}): {argv[0]} raised {exc!r}")
            out, err = capsys.readouterr()
            bad = RAW_CONTROL.search(out + err)
            assert bad is None, (
                f"seed {SEED} round {rounds} ({what}): {argv} printed {bad.group()!r} raw"
            )
            assert code in (0, 1, 2), (SEED, rounds, what, argv, code)
            statuses[code] = statuses.get(code, 0) + 1
            calls += 1
        shutil.rmtree(run, ignore_errors=True)
        rounds += 1
    print(f"\nreader fuzz: seed {SEED}, {rounds} mutated run dirs, {calls} reader calls, "
          f"exit statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(0, 0) > 0 and sum(v for k, v in statuses.items() if k) > 0
