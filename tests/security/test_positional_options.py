"""Options smuggled as positionals (issue 51, finding 3): an entry point that declares
``positional: [str]`` refuses a value that starts with ``-`` with a 400 naming ``args[i]``, so
an argparse script never sees ``-o/some/path`` as its own ``-o`` option; a declaration opts in
with ``leading_dash: true``. The real daemon (its CLI) and a real torchrun job."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from sec_daemon import TOKEN, start_daemon

from tests.support.ports import free_ports

pytestmark = pytest.mark.timeout(120)

WRITER = Path(__file__).resolve().parent / "sec_writer.py"


def test_a_positional_that_starts_with_a_dash_is_a_400(spawn, tmp_path):
    lo = free_ports(10)
    config = tmp_path / "daemon.yaml"
    config.write_text(yaml.safe_dump({
        "entrypoints": {
            "writer": {"script": str(WRITER), "positional": ["str"]},
            "dashes": {"script": str(WRITER), "positional": [{"type": "str",
                                                              "leading_dash": True}]},
        },
        "port_range": [lo, lo + 9], "poll_seconds": 0.25,
    }))
    _, port = start_daemon(spawn, tmp_path, "pos", "--config", str(config))
    url, auth = f"http://127.0.0.1:{port}/api/v1/jobs", {"Authorization": f"Bearer {TOKEN}"}
    target = tmp_path / "outside.txt"

    def submit(job_id: str, entry: str, args: list[str]) -> httpx.Response:
        body = {"id": job_id, "entrypoint": entry, "nproc": 1, "args": args}
        return httpx.post(url, json=body, headers=auth, timeout=10)

    for i, args in enumerate(([f"-o{target}"], ["-o", str(target)], ["alice", "-x"])):
        resp = submit(f"smuggled{i}", "writer", args)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        where = "args[1]" if args[0] == "alice" else "args[0]"
        assert error.startswith(where), error
        if where == "args[0]":
            assert "starts with '-'" in error and "leading_dash: true" in error, error
        assert httpx.get(f"{url}/smuggled{i}", timeout=10).status_code == 404
    resp = submit("long", "writer", [f"--out={target}"])  # an undeclared option, as before
    assert resp.status_code == 400 and resp.json()["error"].startswith("args[0]"), resp.text
    # A plain value still runs; the opted-in positional passes a dash through as declared.
    assert submit("plain", "writer", ["alice"]).status_code == 201
    assert submit("opted", "dashes", ["-"]).status_code == 201
    end = time.monotonic() + 90
    while time.monotonic() < end:
        states = {j: httpx.get(f"{url}/{j}", timeout=10).json()["state"]
                  for j in ("plain", "opted")}
        if all(s not in ("PENDING", "RUNNING") for s in states.values()):
            break
        time.sleep(0.25)
    assert states == {"plain": "COMPLETED", "opted": "COMPLETED"}, states
    assert not target.exists()
