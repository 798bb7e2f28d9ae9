"""The run dir's disk fills up mid-run (issue 24, part 3): a real 2-rank ``ddpmon demo`` whose
run dir is a small tmpfs, filled by a filler file while it trains and freed again.

Training finishes every step, both endpoints answer throughout, the failed writes are counted
per probe and said once per rank, no half-written file is left, the history is readable during
the full period and complete afterwards, and each rank's ``write_gap`` event is in the timeline.
A NaN and a loss-scale collapse happen while the disk is full, so event lines and evidence
bundles fail too.
"""

from __future__ import annotations

import json
import time

from ddpmon.forensics.timeline import build_timeline, describe
from ddpmon.recorder.eventlog import read_events
from tests.support.demo import DemoRun
from tests.support.scrape import scrape as scrape_metrics
from tests.support.tmpfs import small_tmpfs

STEPS = 150
FILL_AT = 30
NAN_AT = 55
COLLAPSE_AT = 75
"""While the disk is full: a NaN on rank 1 (an evidence bundle), then inf gradients on every
step (two event lines a step, more than the slack in the last page of an event log takes)."""
FREE_AT = 100


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """One rank's /metrics keyed by name and ``probe`` label; raises if it does not answer."""
    return scrape_metrics(port, keep=lambda label: label == "probe", timeout=5)


def step_of(sample: dict) -> int:
    return int(sample.get(("ddpmon_step", ()), -1))


def errors(sample: dict, probe: str) -> float:
    return sample.get(("ddpmon_agent_errors_total", (("probe", probe),)), 0.0)


def wait_steps(demo: DemoRun, at_least: int, timeout: float = 60.0) -> list[dict]:
    """Scrape every rank until each has completed ``at_least`` steps; the last scrapes."""
    deadline = time.monotonic() + timeout
    while True:
        demo.track()
        assert demo.proc is not None and demo.proc.poll() is None, demo.log_tail()
        try:
            samples = [scrape(p) for p in demo.ports]
            if min(step_of(s) for s in samples) >= at_least:
                return samples
        except OSError:
            pass  # not serving yet
        assert time.monotonic() < deadline, f"no step {at_least}: {demo.log_tail()}"
        time.sleep(0.2)


def test_a_full_disk_mid_run_costs_the_files_nothing_but_the_gap(tmp_path):
    with small_tmpfs(tmp_path / "runs", "4m") as disk:  # DemoRun's run dir is workdir/runs
        demo = DemoRun(tmp_path, tmp_path / "sd", steps=STEPS, step_delay=0.05,
                       injects=[f"nan@rank1:step{NAN_AT}", f"scale-collapse@step{COLLAPSE_AT}"],
                       run_id="full")
        with demo:
            wait_steps(demo, FILL_AT)
            filled = disk.fill()
            filled_at = time.monotonic()
            steps_at_fill = [step_of(s) for s in wait_steps(demo, 0)]
            assert max(steps_at_fill) < NAN_AT, "too slow: the NaN came before the disk filled"
            # full: every scrape of every rank must answer until the disk is freed
            scrapes = 0
            while True:
                samples = [scrape(p) for p in demo.ports]  # raises if an endpoint is down
                scrapes += 1
                if min(step_of(s) for s in samples) >= FREE_AT:
                    break
                time.sleep(0.25)
            full_seconds = time.monotonic() - filled_at
            during = {r: read_history_now(demo, r) for r in range(demo.nproc)}
            for rank, s in enumerate(samples):
                assert errors(s, "history") > 0, (rank, s)
            disk.free()
            rc = demo.wait(timeout=120)
        out = demo.log_path.read_text(errors="replace")
        assert rc == 0, out[-4000:]
        run = demo.run_path

        # training went on: every rank completed every step
        for rank in range(demo.nproc):
            summary = json.loads((run / f"summary.rank{rank}.json").read_text())
            assert summary["steps"] == STEPS and summary["last_step"] == STEPS - 1, summary
            assert summary["agent_errors"]["history"] > 0
        assert json.loads((run / "summary.rank1.json").read_text())["agent_errors"]["evidence"] >= 1

        # one line per rank when writes start failing, one when they resume
        for rank in range(demo.nproc):
            where = f"rank {rank} run dir {run}"
            assert out.count(f"{where}: writes fail") == 1, out[-4000:]
            assert out.count(f"{where}: writes resume") == 1, out[-4000:]
        assert "probe 'history' failed" not in out and "probe 'eventlog' failed" not in out

        # nothing half-written: no temp file, every JSON file parses, every event line is whole
        assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name]
        for path in run.rglob("*.json"):
            json.loads(path.read_text())
        for rank in range(demo.nproc):
            assert read_events(run / f"events.rank{rank}.jsonl")[1] == 0

        # the history was readable up to its last good batch while full, and is complete now
        from ddpmon.recorder.history_read import read_history

        for rank in range(demo.nproc):
            assert during[rank] and max(during[rank]) < FREE_AT
            steps = list(read_history(run / f"history.rank{rank}.arrow").columns["step"])
            assert steps == list(range(STEPS)), (rank, steps[:5], len(steps))

        # each rank recorded its gap once, and the timeline shows it
        gaps = {}
        for rank in range(demo.nproc):
            events = read_events(run / f"events.rank{rank}.jsonl")[0]
            [gap] = [e for e in events if e["kind"] == "write_gap"]
            gaps[rank] = gap
            assert gap["failures"]["history"] > 0 and gap["seconds"] > 0
            # from the rows not yet written when the disk filled to the last step lost or late
            assert 0 < gap["first_step"] < COLLAPSE_AT <= gap["last_step"] <= STEPS
            assert events[-1]["kind"] == "exit"  # written after the disk was freed
        assert gaps[1]["lost"].get("evidence", 0) >= 1
        # lost bundles count toward evidence_max_per_kind (5): attempts stay bounded
        assert all(g["failures"].get("evidence", 0) <= 2 * 5 for g in gaps.values())
        lost_events = sum(g["lost"].get("eventlog", 0) for g in gaps.values())
        assert lost_events > 0
        timeline = build_timeline(run).to_json()
        shown = [e for e in timeline["events"] if e.get("kind") == "write_gap"]
        assert sorted(e["rank"] for e in shown) == [0, 1]
        assert all("writes failed for" in describe(e) for e in shown)
        print(json.dumps({
            "filled_bytes": filled, "steps_at_fill": steps_at_fill, "full_seconds": full_seconds,
            "scrapes_while_full": scrapes, "lost_event_lines": lost_events,
            "gaps": {r: {k: g[k] for k in ("seconds", "first_step", "last_step", "failures",
                                             "lost", "detail")} for r, g in gaps.items()},
        }, indent=1))


def read_history_now(demo: DemoRun, rank: int) -> list[int]:
    """The steps the rank's history holds right now (the disk still full)."""
    from ddpmon.recorder.history_read import read_history

    try:
        return list(read_history(demo.run_path / f"history.rank{rank}.arrow").columns["step"])
    except (FileNotFoundError, ValueError):
        return []
