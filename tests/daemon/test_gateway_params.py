"""The job gateway runs only what its allow-list declares: every request argument is parsed
against the entry point's typed declaration (``ddpmon.daemon.params``), a path is confined to the
job's own directory, and the demo entry point cannot be pointed at another run dir, discovery
dir or daemon. Checked on the parser, on the settings file and through the real daemon's API."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ddpmon.daemon.params import ParamError, inside
from ddpmon.daemon.settings import DaemonSettings, SettingsError

from .conftest import Daemon

JOB = Path("/state/jobs/j1")


def demo_args(args: list[str]) -> list[str]:
    return DaemonSettings().entrypoints["demo"].check_args(args, JOB)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--run-dir", "/tmp/elsewhere"], "args[0]: '--run-dir' is not an argument"),
        (["--sd-dir", "/etc/prometheus"], "'--sd-dir' is not an argument"),
        (["--daemon-url", "http://10.0.0.1"], "'--daemon-url' is not an argument"),
        (["--port", "22"], "'--port' is not an argument"),
        (["--checkpoint-dir", "/root/.ssh"], "must be a relative path inside the job directory"),
        (["--checkpoint-dir", "ckpt/../../other-job"], "leaves the job directory"),
        (["--checkpoint-dir", "~/x"], "must be a relative path"),
        (["--steps", "ten"], "--steps expects an integer, got 'ten'"),
        (["--step-delay", "nan"], "expects a finite number"),
        (["--on-nonfinite", "explode"], "expects one of record, skip, raise"),
        (["--autocast", "float64"], "--autocast expects one of none, float16, bfloat16"),
        (["--steps", "5", "--steps", "6"], "args[2]: --steps given twice"),
        (["--resume=yes"], "--resume is a flag and takes no value"),
        (["--steps"], "args[0]: --steps needs a value"),
        (["--", "--run-dir", "/x"], "a bare '--' is not accepted"),
        (["train.py"], "takes 0 positional argument(s)"),
        (["--st\x1b[31meps", "1"], r"'--st\x1b[31meps'"),  # shown escaped, never raw
    ],
)
def test_the_demo_entry_point_refuses_what_it_does_not_declare(args, needle):
    with pytest.raises(ParamError) as info:
        demo_args(args)
    assert needle in str(info.value)


def test_declared_arguments_pass_and_paths_land_in_the_job_directory():
    out = demo_args(
        ["--steps=30", "--inject", "nan@rank1:step5", "--inject", "kill@rank0:step9",
         "--checkpoint-dir", "ckpt", "--resume", "--resume-without", "rng", "--no-amp",
         "--autocast", "bfloat16"]
    )
    assert out == [
        "--steps", "30", "--inject", "nan@rank1:step5", "--inject", "kill@rank0:step9",
        "--checkpoint-dir", str(JOB / "ckpt"), "--resume", "--resume-without", "rng", "--no-amp",
        "--autocast", "bfloat16",
    ]


def test_an_entry_point_without_a_declaration_takes_no_arguments():
    s = DaemonSettings.from_dict({"entrypoints": {"train": {"script": "/opt/train.py"}}})
    assert s.entrypoints["train"].check_args([], JOB) == []
    with pytest.raises(ParamError, match="'--anything' is not an argument of entrypoint 'train'"):
        s.entrypoints["train"].check_args(["--anything"], JOB)


def test_a_declaration_with_types_and_positionals():
    s = DaemonSettings.from_dict({"entrypoints": {"train": {
        "script": "/opt/train.py",
        "params": {"--size": {"type": "choice", "choices": ["s", "l"]}, "--out": "path"},
        "positional": ["float"],
    }}})
    entry = s.entrypoints["train"]
    assert entry.check_args(["2.5", "--size", "l", "--out", "o"], JOB) == [
        "2.5", "--size", "l", "--out", str(JOB / "o")
    ]
    with pytest.raises(ParamError, match="positional 0 expects a finite number"):
        entry.check_args(["fast"], JOB)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"params": {"--x": "pickle"}}, "entrypoints.t.params.--x: type 'pickle'"),
        ({"params": {"x": "int"}}, "is not an option name"),
        ({"params": {"--x": {"type": "choice"}}}, "needs a non-empty list"),
        ({"params": {"--x": {"type": "int", "shell": True}}}, "unknown key(s) ['shell']"),
        ({"positional": ["flag"]}, "cannot be a flag"),
        ({"params": {"--x": {"type": "str", "leading_dash": True}}}, "positional values only"),
        ({"positional": [{"type": "str", "leading_dash": "yes"}]}, "leading_dash: expected"),
    ],
)
def test_a_bad_declaration_is_a_settings_error_naming_the_key(spec, needle):
    with pytest.raises(SettingsError) as info:
        DaemonSettings.from_dict({"entrypoints": {"t": {"script": "/x", **spec}}})
    assert needle in str(info.value)


def test_a_link_planted_in_the_job_directory_is_caught(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "ckpt").symlink_to(tmp_path)
    assert inside(job / "plain", job)
    assert not inside(job / "ckpt" / "x", job)
    os.mkdir(job / "real")
    assert inside(job / "real" / "x", job)


def test_the_real_daemon_answers_400_naming_the_argument(daemon: Daemon) -> None:
    cases = {
        "run dir": ["--run-dir", "/tmp"],
        "absolute checkpoint dir": ["--checkpoint-dir", "/tmp/planted", "--resume"],
    }
    for name, args in cases.items():
        resp = httpx.post(
            daemon.url + "/api/v1/jobs", headers=daemon.auth,
            json={"id": "p1", "entrypoint": "demo", "nproc": 1, "args": args},
        )
        assert resp.status_code == 400, (name, resp.text)
        assert resp.json()["error"].startswith("args[0]") or "args[1]" in resp.json()["error"]
    assert daemon.get("/api/v1/jobs/p1").status_code == 404  # nothing was created
