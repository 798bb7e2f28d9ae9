"""Slurm, really run (docs/slurm.md): munged, slurmctld and two slurmd nodes in their own network
namespaces (``tests/support/slurm.py``), a real Prometheus and Alertmanager in the root
namespace, and jobs submitted with ``sbatch`` whose training script has one ``ddpmon.attach``
line (``_train.py``). The job scripts are the ones docs/slurm.md shows."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpmon.mixin import shipped
from ddpmon.mixin.config import MixinConfig
from tests.support.ports import free_port
from tests.support.slurm import SlurmUnavailable, start
from tests.support.stack import WebhookReceiver, live_stack

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
        f"--out {out} --steps 40 --step-delay 0.2 --nan 3:5'",
        "--nodes=2", "--ntasks-per-node=2", f"--output={tmp_path}/slurm-%j.out",
        DDPMON_RUN_DIR=runs, DDPMON_PORT=free_port(), DDPMON_LINGER_SECONDS=3)
    urls = [f"http://{n.addr}:{daemon}/sd" for n in slurm.nodes]
    with WebhookReceiver() as hook, live_stack(
            tmp_path / "stack", tmp_path / "no-sd", MixinConfig(), hook.url,
            prometheus_base=shipped.path(shipped.PROMETHEUS_SLURM_YML),
            http_sd_urls=urls) as stack:
        job = slurm.sbatch(script)
        try:
            page = hook.wait_for_alert("DdpmonNonFiniteGradients", 180,
                                       where=lambda a: a.labels.get("run") == job)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{slurm.job(job)}\n{slurm.logs()}") from exc
        done = slurm.wait_state(job, ("COMPLETED", "FAILED"), 120)
        assert done["JobState"] == "COMPLETED", (done, (tmp_path / f"slurm-{job}.out"))
        scraped = stack.prometheus.query(f'max_over_time(ddpmon_step{{run="{job}"}}[10m])')
        labels = stack.prometheus.query(f'up{{run="{job}"}}')
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
    assert f"Slurm: job {job} COMPLETED (exit 0:0) [scontrol]" in text, text
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


def test_a_requeued_job_numbers_its_attempts_on_one_timeline(slurm, tmp_path):
    """``sbatch --requeue``, then ``scontrol requeue`` mid-run: the second run of the job is
    attempt 1 (``SLURM_RESTART_COUNT``), both attempts on one timeline with Slurm's count."""
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
    deadline = time.monotonic() + 120
    while len(events(run, "step") if run.exists() else []) < 2 and \
            len([e for e in events(run, "start")] if run.exists() else []) < 2:
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.5)
    res = slurm.run("scontrol", "requeue", job)
    assert res.returncode == 0, res.stderr
    done = slurm.wait_state(job, ("COMPLETED", "FAILED"), 240)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", done
    facts = ranks(out)
    assert {(r["attempt"], r["rank"]) for r in facts} == {(1, 0), (1, 1)}, facts
    starts = events(run, "start")
    assert sorted((e["attempt"], e["rank"]) for e in starts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    text = timeline(run, slurm.env).stdout
    assert "Attempts (2, one clock)" in text, text
    assert f"Slurm: job {job} COMPLETED (exit 0:0, requeued 1 time) [scontrol]" in text, text
