"""Discovery squatting (issue 51, finding 2): a run id that names a daemon job is the job's own.
A local process that is not the job's (this test process) cannot register the job's ranks;
the attempt is refused (403) and logged with what it tried. An entry it made before the job
existed is no longer served under the job's labels once the job does, and the job's own rank
(the real demo under torchrun, registering through the agent socket) replaces it. Real daemon
CLI, real job, real sockets."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import yaml
from sec_daemon import TOKEN, start_daemon

from tests.support.agent_call import call as agent_call
from tests.support.agent_call import wait_for_socket
from tests.support.ports import free_ports

pytestmark = pytest.mark.timeout(180)


def sd(port: int, run: str) -> list[tuple[str, str]]:
    groups = httpx.get(f"http://127.0.0.1:{port}/sd", timeout=10).json()
    return [(g["labels"]["rank"], t) for g in groups if g["labels"]["run"] == run
            for t in g["targets"]]


def test_only_the_jobs_own_processes_register_its_ranks(spawn, tmp_path):
    lo = free_ports(10)
    config = tmp_path / "daemon.yaml"
    config.write_text(yaml.safe_dump({
        "entrypoints": {"demo": {"module": "ddpmon.demo.train"}},
        "port_range": [lo, lo + 9], "poll_seconds": 0.25,
    }))
    proc, port = start_daemon(spawn, tmp_path, "sq", "--config", str(config))
    sock = tmp_path / "sq-state" / "agent.sock"
    wait_for_socket(sock)
    jobs, auth = f"http://127.0.0.1:{port}/api/v1/jobs", {"Authorization": f"Bearer {TOKEN}"}
    with socket.create_server(("127.0.0.1", 0)) as own:
        squat = {"run": "victim", "rank": 0, "port": own.getsockname()[1], "host": "127.0.0.1",
                 "job_id": "victim"}
        # Before the job exists, "victim" is any run id: the entry is taken and served.
        status, doc = agent_call(sock, "POST", "/api/v1/ranks", squat)
        assert status == 201, doc
        assert sd(port, "victim") == [("0", f"127.0.0.1:{squat['port']}")]

        body = {"id": "victim", "entrypoint": "demo", "nproc": 1,
                "args": ["--steps", "100000", "--step-delay", "0.1"]}
        assert httpx.post(jobs, json=body, headers=auth, timeout=10).status_code == 201
        assert sd(port, "victim") == []  # the job exists: the squatter's entry is not served
        status, doc = agent_call(sock, "POST", "/api/v1/ranks", squat)
        assert status == 403 and "is not a process of the job" in doc["error"], doc

        job = httpx.get(f"{jobs}/victim", timeout=10).json()
        job_port = job["ports"][0]
        end = time.monotonic() + 120
        while sd(port, "victim") != [("0", f"127.0.0.1:{job_port}")]:
            assert time.monotonic() < end, (sd(port, "victim"), proc.output_path.read_text())
            time.sleep(0.25)
        # Once the job's rank is registered, claims on it or on a rank the job does not have
        # are refused the same way, and the job's entry stays.
        for claim in ({**squat, "rank": 1}, squat):
            status, doc = agent_call(sock, "POST", "/api/v1/ranks", claim)
            assert status == 403, doc
        assert sd(port, "victim") == [("0", f"127.0.0.1:{job_port}")]

    log = proc.output_path.read_text()
    refused = [line for line in log.splitlines() if "refused rank registration (403)" in line]
    assert len(refused) == 3 and all(str(squat["port"]) in line for line in refused), log
    assert "claimed rank 0 of run 'victim'" in refused[0], refused
    assert "replaces the entry of pid" in log, log
    # The job listing stays open to clients without the token (ddpmon jobs, dashboards):
    # knowing a job id no longer lets anyone register its ranks.
    listed = httpx.get(jobs, timeout=10).json()["jobs"]
    assert [j["id"] for j in listed] == ["victim"]
    assert httpx.delete(f"{jobs}/victim", headers=auth, timeout=10).status_code == 202
    end = time.monotonic() + 60
    while httpx.get(f"{jobs}/victim", timeout=10).json()["state"] == "RUNNING":
        assert time.monotonic() < end
        time.sleep(0.25)
    print("\n" + "\n".join(json.dumps(line) for line in refused))
