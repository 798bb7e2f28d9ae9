"""Hardware or numerics, tried as a new user would (docs/forensics/hardware-or-numerics.md):
``ddpmon demo`` on 4 DDP ranks with ``--on-nonfinite rerun`` and a replica check every 5 steps,
scraped by a real Prometheus that evaluates the shipped rules and pages a webhook through a
real Alertmanager. Three faults in one run:

- a one-off NaN in rank 1's backward at step 6: the rerun is clean, so it is *transient*, named
  with rank 1's device, and the step is skipped;
- one bit of rank 2's weights flipped after step 12: ``DdpmonReplicaDiverged`` pages for rank 2,
  and only rank 2, from the check at step 15 (within one interval);
- a batch that always fails on rank 3 at step 36: *deterministic*, named with its sample ids,
  and every rank raises at that step.

The timeline's last line gives the layer of the first of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.mixin.config import MixinConfig
from tests.support.demo import DemoRun
from tests.support.stack import WebhookReceiver, live_stack

pytestmark = pytest.mark.timeout(300)

NAN_STEP, FLIP_STEP, BAD_STEP, EVERY = 6, 12, 36, 5
RUN = "hw"


def _events(demo: DemoRun, kind: str) -> list[dict]:
    return [e for r in range(4) for e in demo.events(r) if e.get("kind") == kind]


def test_a_flip_pages_a_transient_and_a_bad_batch_are_told_apart(tmp_path: Path) -> None:
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    injects = [f"nan@rank1:step{NAN_STEP}", f"bitflip@rank2:step{FLIP_STEP}",
               f"bad-batch@rank3:step{BAD_STEP}"]
    with (
        WebhookReceiver() as hook,
        live_stack(tmp_path / "stack", sd_dir, MixinConfig(), hook.url) as stack,
        DemoRun(tmp_path / "demo", sd_dir, 60, 0.15, injects, run_id=RUN, nproc=4,
                extra=["--on-nonfinite", "rerun", "--replica-check-every", str(EVERY)]) as demo,
    ):
        try:
            page = hook.wait_for_alert("DdpmonReplicaDiverged", 150,
                                       where=lambda a: a.labels.get("run") == RUN)
            code = demo.wait(timeout=150)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{demo.log_tail()}") from exc
        assert page.labels["rank"] == "2" and page.labels["severity"] == "critical"
        assert code == 1, demo.log_tail()  # the deterministic step raised on every rank
        diverged = {a.labels["rank"] for a in hook.alerts if a.name == "DdpmonReplicaDiverged"}
        assert diverged == {"2"}
        reruns = stack.prometheus.query(
            f'max_over_time(ddpmon_step_reruns_total{{run="{RUN}",fault="transient"}}[10m])')
        assert sorted(float(r["value"][1]) for r in reruns) == [1.0] * 4, reruns

    (flip,) = [e for e in _events(demo, "replica_mismatch") if e["step"] <= FLIP_STEP + EVERY]
    assert flip["rank"] == 2 and flip["ranks"] == [2] and flip["replicas"] == 4

    origins = [e for e in _events(demo, "rerun") if e["origin"]]
    transient, deterministic = sorted(origins, key=lambda e: e["step"])
    assert (transient["rank"], transient["step"], transient["fault"]) == (1, NAN_STEP,
                                                                           "transient")
    assert transient["device"] == "cpu" and transient["action"] == "skip"
    assert (deterministic["rank"], deterministic["step"]) == (3, BAD_STEP)
    assert deterministic["fault"] == "deterministic" and deterministic["action"] == "raise"
    # the demo's global batch is 32 (8 per rank): rank 3's samples at step 36
    first_id = BAD_STEP * 32 + 3 * 8
    assert deterministic["sample_ids"] == list(range(first_id, first_id + 8))

    timeline = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "timeline", str(demo.run_path)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                         "COLUMNS": "400"},
    )
    last = timeline.stdout.strip().splitlines()[-1]
    assert last.startswith("Verdict: hardware (transient on rank 1, cpu: a non-finite "
                           f"gradient at step {NAN_STEP} did not reproduce"), timeline.stdout
