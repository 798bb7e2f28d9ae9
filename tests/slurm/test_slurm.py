"""Slurm, really run (docs/slurm.md): munged, slurmctld and two slurmd nodes in their own network
namespaces (``tests/support/slurm.py``), a real Prometheus and Alertmanager in the root
namespace, and jobs submitted with ``sbatch`` whose training script has one ``ddpmon.attach``
line (``_train.py``). The job scripts are the ones docs/slurm.md shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from ddpmon.forensics import slurm_outcome
from ddpmon.mixin import shipped
from ddpmon.mixin.config import MixinConfig
from ddpmon.recorder.eventlog import read_progress
from tests.support.ports import free_port
from tests.support.slurm import SlurmUnavailable, start
from tests.support.stack import WebhookReceiver, live_stack, wait_for

pytestmark = pytest.mark.timeout(420)

TRAIN = Path(__file__).with_name("_train.py")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.close()


def job_script(path: Path, body: str, *sbatch: str, **env: str) -> Path:
    exports = "".join(f"export {k}={v}\n" for k, v in env.items())
    lines = "".join(f"#SBATCH {o}\n" for o in sbatch)
    path.write_text(f"#!/bin/bash\n{lines}"
                    'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | '
                    f"head -n1) MASTER_PORT={free_port()}\n{exports}{body}\n")
    return path


def ranks(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                  key=lambda r: (r["attempt"], r["rank"]))


def events(run: Path, kind: str | None = None) -> list[dict]:
    found = []
    for path in sorted(run.glob("events.rank*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in found if kind is None or e["kind"] == kind]


def timeline(run: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "timeline", str(run), *args],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin:/usr/sbin", "COLUMNS": "300", **env})


def test_srun_without_torchrun_two_nodes_nan_pages_and_names_the_rank(slurm, tmp_path):
    """2 nodes x 2 tasks, ``srun python train.py``, a ``ddpmon daemon`` per node for the job:
    identity from SLURM_*, the run named by the job id, every rank discovered through the
    daemons' /sd (the shipped prometheus-slurm.yml) with the job's labels, the NaN on rank 3
    (node-b) pages, the timeline names it, and nothing of the job is left running."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    gate = tmp_path / "nan-gate"
    daemon = free_port()
    script = job_script(
        tmp_path / "job.sh",
        # the node daemons, for the job's lifetime (Slurm ends the step with the job)
        "srun --ntasks-per-node=1 --overlap bash -c 'exec "
        f"{sys.executable} -m ddpmon.cli daemon --bind $(hostname -i) --port {daemon} "
        f"--state-dir {tmp_path}/daemon-$SLURMD_NODENAME --node $SLURMD_NODENAME' &\n"
        "for node in $(scontrol show hostnames \"$SLURM_JOB_NODELIST\"); do\n"
        f"  until {sys.executable} -c \"import socket,sys; socket.create_connection((sys.argv[1],"
        f" {daemon}), 1)\" $node 2>/dev/null; do sleep 0.2; done\n"
        "done\n"
        "srun bash -c 'export DDPMON_BIND=$(hostname -i) "
        f"DDPMON_DAEMON_URL=http://$(hostname -i):{daemon}; exec {sys.executable} {TRAIN} "
        f"--out {out} --steps 40 --step-delay 0.2 --nan 3:5 --nan-gate {gate}'",
        "--nodes=2", "--ntasks-per-node=2", f"--output={tmp_path}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=free_port(), DDPMON_LINGER_SECONDS=3)
    urls = [f"http://{n.addr}:{daemon}/sd" for n in slurm.nodes]
    with WebhookReceiver() as hook, live_stack(
            tmp_path / "stack", tmp_path / "no-sd", MixinConfig(), hook.url,
            prometheus_base=shipped.path(shipped.PROMETHEUS_SLURM_YML),
            http_sd_urls=urls) as stack:
        job = slurm.sbatch(script)
        try:
            # The NaN waits until Prometheus scrapes all four ranks: 20 non-finite steps (4 s)
            # page without an origin (DdpmonNonFiniteGradients' persistent branch), and under
            # load node-b's ranks were discovered after that (h10: "Origin rank(s) ...: none").
            wait_for(lambda: len(stack.prometheus.query(f'up{{run="{job}"}} == 1')) == 4, 120,
                     what="Prometheus scraping the job's four ranks")
            gate.touch()
            page = hook.wait_for_alert("DdpmonNonFiniteGradients", 180,
                                       where=lambda a: a.labels.get("run") == job)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{slurm.job(job)}\n{slurm.logs()}") from exc
        done = slurm.wait_state(job, ("COMPLETED", "FAILED"), 120)
        assert done["JobState"] == "COMPLETED", (done, (tmp_path / f"slurm-{job}.out"))
        scraped = stack.prometheus.query(f'max_over_time(ddpmon_step{{run="{job}"}}[10m])')
        # over the run: once the job ended its targets are gone and `up` is stale
        labels = stack.prometheus.query(f'max_over_time(up{{run="{job}"}}[10m])')
    assert page.annotations["description"].rstrip(".").endswith(": 3"), page.annotations
    assert sorted(int(r["metric"]["rank"]) for r in scraped) == [0, 1, 2, 3]
    assert {r["metric"]["slurm_job"] for r in labels} == {job}
    assert {r["metric"]["slurm_partition"] for r in labels} == {"debug"}
    assert {r["metric"]["slurm_user"] for r in labels} == {"root"}
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == [], left  # the daemons and the ranks ended with the job

    facts = ranks(out)
    assert [(r["rank"], r["local_rank"], r["node"]) for r in facts] == [
        (0, 0, "node-a"), (1, 1, "node-a"), (2, 0, "node-b"), (3, 1, "node-b")]
    assert {(r["world_size"], r["run_id"], r["attempt"]) for r in facts} == {(4, job, 0)}
    run = runs / job
    manifest = json.loads((run / "manifest.json").read_text())
    # step 0 is the daemons' srun, step 1 the ranks'
    assert manifest["slurm"]["job_id"] == job and manifest["slurm"]["step_id"] == "1"
    assert manifest["slurm"]["allocation"]["nodes"] == "node-a,node-b"
    assert manifest["slurm"]["allocation"]["tasks_per_node"] == "2(x2)"
    assert manifest["slurm"]["partition"] == "debug"

    text = timeline(run, slurm.env).stdout
    assert "First failure: rank 3, step 5" in text, text
    assert f"Slurm: job {job} COMPLETED (exit 0:0) [sacct]" in text, text
    assert text.strip().splitlines()[-1].startswith("Verdict: numerics"), text


def test_torchrun_inside_the_allocation_keeps_its_ranks_and_the_job_labels_the_run(
        slurm, tmp_path):
    """One task per node runs torchrun (2 workers each): torchrun's ranks win; the run is
    still the job's, and the manifest names its step."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    rdzv = free_port()
    script = job_script(
        tmp_path / "job.sh",
        f"srun bash -c 'exec {sys.executable} -m torch.distributed.run --nnodes 2 "
        f"--nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{rdzv} "
        f"--rdzv-id $SLURM_JOB_ID --local-addr $(hostname -i) {TRAIN} --out {out} --steps 4 "
        "--step-delay 0'",
        "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=0)
    job = slurm.sbatch(script)
    done = slurm.wait_state(job, ("COMPLETED", "FAILED"), 180)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert done["JobState"] == "COMPLETED", log[-3000:]
    facts = ranks(out)
    assert sorted((r["node"], r["local_rank"]) for r in facts) == [
        ("node-a", 0), ("node-a", 1), ("node-b", 0), ("node-b", 1)]
    assert {(r["world_size"], r["run_id"]) for r in facts} == {(4, job)}
    manifest = json.loads((runs / job / "manifest.json").read_text())
    assert manifest["slurm"]["job_id"] == job and manifest["slurm"]["step_id"] == "0"


def _wait_stepping(slurm, run: Path, job: str, ranks: int, timeout: float = 120) -> None:
    """Until every rank has completed a few steps (its progress file): a kill before the first
    step leaves an attempt of start-up only, with no progress to lose."""
    deadline = time.monotonic() + timeout
    while sum((read_progress(p) or {}).get("step", -1) >= 2
              for p in run.glob("progress.rank*.json")) < ranks:
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.3)


def _wait_started(slurm, run: Path, job: str, ranks: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(events(run, "start") if run.exists() else []) < ranks:
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.3)


def test_a_killed_node_requeues_the_job_and_both_attempts_share_one_timeline(slurm, tmp_path):
    """``sbatch --requeue``; node-b dies mid-run (slurmd and the job's processes SIGKILLed) and
    comes back: Slurm requeues the job, its second run is attempt 1 (``SLURM_RESTART_COUNT``),
    and the timeline lines up both attempts, names the rank that vanished, and gives Slurm's
    count of requeues."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    script = job_script(
        tmp_path / "job.sh",
        f"srun bash -c 'exec {sys.executable} {TRAIN} --out {out} --steps 30 "
        "--step-delay 0.2'",
        "--nodes=2", "--ntasks-per-node=1", "--requeue", f"--output={tmp_path}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=0)
    job = slurm.sbatch(script)
    run = runs / job
    _wait_started(slurm, run, job, 2)
    _wait_stepping(slurm, run, job, 2)
    killed_at = time.time()  # the last progress: steps were running until now
    slurm.kill_node("node-b")
    slurm.wait_state(job, ("PENDING", "REQUEUED", "CONFIGURING"), 60)
    slurm.start_node("node-b")
    done = slurm.wait_state(job, ("COMPLETED", "FAILED"), 240)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", done
    facts = ranks(out)
    assert {(r["attempt"], r["rank"]) for r in facts} == {(1, 0), (1, 1)}, facts
    starts = events(run, "start")
    assert sorted((e["attempt"], e["rank"]) for e in starts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    text = timeline(run, slurm.env).stdout
    assert "Attempts (2, one clock)" in text, text
    assert (f"Slurm: job {job} COMPLETED (exit 0:0, requeued 1 time after NODE_FAIL) [sacct]"
            in text), text
    _requeue_is_a_restart_gap(run, slurm.env, killed_at, min(r["born"] for r in facts))


def _requeue_is_a_restart_gap(run: Path, env: dict[str, str], killed_at: float,
                              reborn: float) -> None:
    """Goodput across the requeue: attempt 1 starts when its processes were born (their own
    clock), and from the last progress (the node's death) to then is attempt 0's failure
    detection (until its last event) and its restart gap (the requeue: Slurm's requeue delay
    and the new processes' start)."""
    g = json.loads(timeline(run, env, "--json").stdout)["goodput"]
    first, second = g["attempts"]
    assert second["t_rel_start"] == pytest.approx(first["t_rel_end"], abs=1e-6)
    gap = first["buckets"]["restart_gap"]
    assert gap > 0, first
    dead = first["buckets"]["failure_detection"] + gap + first["buckets"]["other"]
    # from the last step (a step is 0.2 s) to the new process's start (Python's start-up
    # before its clock is read)
    assert dead == pytest.approx(reborn - killed_at, abs=3.0), (first, reborn - killed_at)


def test_scancel_ends_the_job_with_slurms_reason_on_the_timeline(slurm, tmp_path, monkeypatch):
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    script = job_script(
        tmp_path / "job.sh",
        f"srun bash -c 'exec {sys.executable} {TRAIN} --out {out} --steps 600 "
        "--step-delay 0.2'",
        "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=0)
    job = slurm.sbatch(script)
    run = runs / job
    _wait_started(slurm, run, job, 2)
    # The job id reaches the timeline through the manifest. Rank 0 writes it at attach, before
    # its start event (it used to wait for the first step, and a scancel 40 ms after the start
    # events left a run with no manifest and a timeline with no Slurm line): cancel now.
    assert (run / "manifest.json").exists()
    assert slurm.run("scancel", job).returncode == 0
    slurm.wait_state(job, ("CANCELLED",), 60)
    deadline = time.monotonic() + 30  # slurmstepd ends the steps (SIGTERM, then SIGKILL)
    while left := [p.info for p in psutil.process_iter(["pid", "cmdline"])
                   if str(tmp_path) in " ".join(p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, left  # nothing of the job outlives scancel
        time.sleep(0.3)
    text = timeline(run, slurm.env).stdout
    assert f"Slurm: job {job} CANCELLED" in text, text
    assert "signal SIGTERM" in text or "vanished" in text, text  # ddpmon's view of the end
    as_json = json.loads(timeline(run, slurm.env, "--json").stdout)
    assert as_json["slurm"]["state"].startswith("CANCELLED"), as_json["slurm"]
    assert as_json["slurm"]["job_id"] == job and as_json["slurm"]["source"] == "sacct"
    # where no accounting runs, the controller's memory of the job says the same
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    fallback = slurm_outcome._scontrol(job, 10)
    assert fallback is not None and fallback["state"] == "CANCELLED", fallback
    assert fallback["source"] == "scontrol"


@pytest.fixture(scope="module", autouse=True)
def time_limited_job(slurm, tmp_path_factory):
    """A job with a one-minute limit (Slurm's smallest), submitted before the module's first
    test so that its minute passes while the others run (4 CPUs a node leave room for it)."""
    base = tmp_path_factory.mktemp("time-limit")
    runs, out = base / "runs", base / "out"
    runs.mkdir()
    out.mkdir()
    script = job_script(
        base / "job.sh",
        f"srun bash -c 'exec {sys.executable} {TRAIN} --out {out} --steps 100000 "
        "--step-delay 0.5'",
        # on node-a: the requeue test kills node-b
        "--nodes=1", "--nodelist=node-a", "--ntasks=2", "--time=1",
        f"--output={base}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=0)
    return slurm.sbatch(script), runs


@pytest.fixture(scope="module", autouse=True)
def array_job(slurm, tmp_path_factory):
    """``sbatch --array=0-1``, one rank a task, submitted with the module's first test (it
    runs beside the others)."""
    base = tmp_path_factory.mktemp("array")
    runs, out = base / "runs", base / "out"
    runs.mkdir()
    out.mkdir()
    script = job_script(
        base / "job.sh",
        # the tasks may share a node: one master port each
        "export MASTER_PORT=$((MASTER_PORT + SLURM_ARRAY_TASK_ID))\n"
        f"mkdir -p {out}/$SLURM_ARRAY_TASK_ID\n"
        f"srun bash -c 'exec {sys.executable} {TRAIN} --out {out}/$SLURM_ARRAY_TASK_ID "
        "--steps 3 --step-delay 0'",
        "--array=0-1", "--ntasks=1", f"--output={base}/slurm-%A_%a.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=0)
    return slurm.sbatch(script), runs, out


def test_an_array_task_is_its_own_run_named_job_underscore_task(slurm, array_job):
    """Each task of an array job is a run of its own, ``<array job>_<task>`` as Slurm spells
    it, with the array ids in its manifest."""
    job, runs, out = array_job
    for task in (0, 1):
        done = slurm.wait_state(f"{job}_{task}", ("COMPLETED", "FAILED"), 180)
        assert done["JobState"] == "COMPLETED", done
        (facts,) = ranks(out / str(task))
        assert (facts["run_id"], facts["world_size"]) == (f"{job}_{task}", 1), facts
        manifest = json.loads((runs / f"{job}_{task}" / "manifest.json").read_text())
        assert manifest["slurm"]["array_job_id"] == job, manifest["slurm"]
        assert manifest["slurm"]["array_task_id"] == str(task), manifest["slurm"]


def test_a_time_limit_ends_the_job_with_slurms_timeout_on_the_timeline(slurm, time_limited_job):
    """Slurm checks limits every 30 s: the job ends between 60 and about 95 s after it starts,
    SIGTERM first, then SIGKILL after ``KillWait``. ``sacct`` says TIMEOUT; ddpmon's ranks saw
    the signal."""
    job, runs = time_limited_job
    slurm.wait_state(job, ("TIMEOUT",), 180)
    text = timeline(runs / job, slurm.env).stdout
    assert f"Slurm: job {job} TIMEOUT (exit " in text and ") [sacct]" in text, text
    assert "signal SIGTERM" in text or "vanished" in text, text


def _daemon(slurm, state: Path, config: Path, port: int, log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpmon.cli", "daemon", "--port", str(port), "--state-dir",
         str(state), "--config", str(config), "--backend", "slurm"],
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **slurm.env})
    out.close()
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def test_the_gateway_submits_to_slurm_follows_cancels_and_readopts(slurm, tmp_path):
    """``ddpmon daemon --backend slurm``: the demo submitted through the job API runs as a
    Slurm job (the same allow-list and token), its status, summary and logs come back, a
    cancel is an ``scancel``, and a daemon restart mid-job re-adopts it."""
    state, port = tmp_path / "state", free_port()
    config = tmp_path / "daemon.yml"
    config.write_text(yaml.safe_dump({"slurm_args": ["--partition=debug"]}))
    log = tmp_path / "daemon.log"
    url = f"http://127.0.0.1:{port}"
    proc = _daemon(slurm, state, config, port, log)
    try:
        auth = {"Authorization": f"Bearer {(state / 'token').read_text().strip()}"}

        def submit(job_id: str, nproc: int, args: list[str]) -> None:
            body = {"id": job_id, "entrypoint": "demo", "nproc": nproc, "args": args}
            resp = httpx.post(f"{url}/api/v1/jobs", json=body, headers=auth, timeout=30)
            assert resp.status_code == 201, resp.text

        def job(job_id: str) -> dict:
            return httpx.get(f"{url}/api/v1/jobs/{job_id}", timeout=10).json()

        def wait(job_id: str, check, timeout: float = 150) -> dict:
            deadline = time.monotonic() + timeout
            while not check(doc := job(job_id)):
                assert time.monotonic() < deadline, (doc, log.read_text()[-2000:])
                time.sleep(0.3)
            return doc

        submit("ok", 2, ["--steps", "40", "--step-delay", "0.25"])
        submit("stop", 1, ["--steps", "2000", "--step-delay", "0.2"])
        refused = httpx.post(f"{url}/api/v1/jobs", json={"id": "x", "entrypoint": "demo",
                                                          "nproc": 1, "args": ["--evil"]},
                             headers=auth, timeout=10)
        assert refused.status_code == 400  # the allow-list, as for the local backend
        running = wait("ok", lambda d: d["summary"].get("ranks_up") == 2)
        slurm_id = running["slurm_job_id"]
        assert slurm.job(slurm_id)["JobName"] == "ddpmon-ok"

        proc.terminate()  # a daemon restart mid-job
        proc.wait(timeout=15)
        proc = _daemon(slurm, state, config, port, log)
        assert "re-adopted job ok (Slurm job" in log.read_text()

        wait("stop", lambda d: d["summary"].get("ranks_up") == 1)
        resp = httpx.delete(f"{url}/api/v1/jobs/stop", headers=auth, timeout=30)
        assert resp.status_code == 202, resp.text
        stopped = wait("stop", lambda d: d["state"] in ("CANCELLED", "FAILED", "COMPLETED"))
        assert stopped["state"] == "CANCELLED", stopped
        assert slurm.wait_state(stopped["slurm_job_id"], ("CANCELLED",), 30)

        done = wait("ok", lambda d: d["state"] in ("COMPLETED", "FAILED", "CANCELLED"))
        assert done["state"] == "COMPLETED", done
        assert {r: s["exit_code"] for r, s in done["ranks"].items()} == {"0": 0, "1": 0}
        assert done["summary"]["max_step"] == 39, done["summary"]  # steps 0-39
        logs = httpx.get(f"{url}/api/v1/jobs/ok/logs", params={"rank": 1, "stream": "stderr"},
                         timeout=10)
        assert logs.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=15)
