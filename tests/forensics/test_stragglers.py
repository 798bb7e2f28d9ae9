"""forensics.stragglers on hand-built step parts, and the agent's step split (agent.step_split)
on hand-made clocks: which rank is named, why, from which step, and what is not named."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ddpmon.agent import step_split
from ddpmon.agent.step_split import StepSplit
from ddpmon.forensics.stragglers import (
    SUSTAIN,
    WARMUP,
    WINDOW,
    describe,
    html_section,
    name_stragglers,
    peer_groups,
    rank_windows,
)
from ddpmon.probes.comm import CollectiveRecorder


def _columns(steps: int, compute: float, data: float = 0.001, slow_from: int | None = None,
             slow_compute: float | None = None, host: float = 0.0005) -> dict:
    step = np.arange(steps, dtype=np.int64)
    forward = np.full(steps, compute / 3)
    if slow_from is not None and slow_compute is not None:
        forward[slow_from:] = slow_compute / 3
    backward = 2 * forward
    return {
        "step": step,
        "data_wait_seconds": np.full(steps, data),
        "forward_seconds": forward,
        "backward_seconds": backward,
        "optimizer_seconds": np.zeros(steps),
        "host_seconds": np.full(steps, host),
        "wait_seconds": np.full(steps, 0.01),
    }


def _windows(columns_by_rank: dict[int, dict]) -> dict[int, dict]:
    return {r: rank_windows(c, WINDOW) for r, c in columns_by_rank.items()}


def test_a_rank_that_computes_15_percent_more_from_step_100_is_named_from_there():
    ranks = {r: _columns(300, 0.1) for r in range(4)}
    ranks[3] = _columns(300, 0.1, slow_from=100, slow_compute=0.115)
    (named,) = name_stragglers(_windows(ranks), WINDOW)
    assert (named["rank"], named["cause"], named["since_step"]) == (3, "compute", 100)
    assert named["until_step"] == 299
    assert named["slowdown"] == round(0.015 / 0.1015, 4)  # rounded to 4 places
    assert ("rank 3 was 14.8 % slower than the other ranks' median (cause: compute) "
            "from step 100") in describe(named)


def test_data_and_host_causes_and_the_largest_slowdown_first():
    ranks = {r: _columns(100, 0.1) for r in range(6)}
    ranks[1] = _columns(100, 0.1, data=0.031)  # +30 ms waiting for data
    ranks[4] = _columns(100, 0.1, host=0.0105)  # +10 ms of the loop's own code
    named = name_stragglers(_windows(ranks), WINDOW)
    # one rank leads each window: the data straggler, further behind, is the only one named
    assert [(s["rank"], s["cause"]) for s in named] == [(1, "data")]
    del ranks[1]
    (host,) = name_stragglers(_windows(ranks), WINDOW)
    assert (host["rank"], host["cause"]) == (4, "host")


def test_short_or_small_slowdowns_and_the_warm_up_are_not_named():
    ranks = {r: _columns(200, 0.1) for r in range(4)}
    # 4 % slower throughout: under the threshold
    ranks[0] = _columns(200, 0.1, slow_from=0, slow_compute=0.1042)
    # 25 % slower for two windows only: not sustained
    short = _columns(200, 0.1, slow_from=50, slow_compute=0.125)
    short["forward_seconds"][50 + (SUSTAIN - 1) * WINDOW:] = 0.1 / 3
    short["backward_seconds"][50 + (SUSTAIN - 1) * WINDOW:] = 0.2 / 3
    ranks[1] = short
    # a first compile: slow for the warm-up steps only
    ranks[2]["forward_seconds"][:WARMUP] = 5.0
    assert name_stragglers(_windows(ranks), WINDOW) == []


def test_histories_without_step_parts_name_nobody():
    cols = _columns(50, 0.1)
    for name in ("forward_seconds", "backward_seconds", "optimizer_seconds", "host_seconds",
                 "wait_seconds"):
        cols[name] = np.full(50, np.nan)
    assert rank_windows(cols, WINDOW) == {}
    assert html_section([]).startswith('<h2>Stragglers</h2><p id="stragglers" class="ok">')
    assert html_section(None) == ""
    assert "&lt;" in html_section([{"rank": "<b>", "slowdown": 0.1, "cause": "compute",
                                    "since_step": 0, "until_step": 9}])


class _Recorder:
    last_issue: float | None = None


def test_step_split_wall_clock_takes_the_wait_after_the_last_collective(monkeypatch):
    """Off the CPU: forward 2, then the backward issues its last all-reduce at 3.5 and ends at
    5: 1.5 s waiting for the other ranks; optimizer 0.5; the step lasts 7 s from its forward."""
    clock = iter([10.0, 12.0, 15.0, 15.5, 16.0, 17.0])
    recorder = _Recorder()
    split = StepSplit(recorder, [torch.zeros(1, device="meta")])
    monkeypatch.setattr(split, "_clock", lambda: next(clock))
    split.forward_started()  # 10
    split.forward_ended()  # 12
    recorder.last_issue = 13.5
    split.backward_ended()  # 15: backward 1.5, wait 1.5
    split.optimizer_started()  # 15.5
    data, fwd, bwd, opt, host, wait, comm = split.finish(7.0, data_wait=0.25)  # now 16
    assert (data, fwd, bwd, opt, wait, comm) == (0.25, 2.0, 1.5, 0.5, 1.5, 0.0)
    assert host == pytest.approx(7.0 - 2.0 - 1.5 - 0.5 - 1.5)
    assert split.finish(1.0, None) is None  # reset: no forward since


def test_step_split_on_cpu_counts_the_threads_cpu_time_and_the_rest_as_wait():
    split = StepSplit(None, [torch.zeros(1)])
    assert split._clock is step_split.time.thread_time
    split.forward_started()
    x = torch.randn(256, 256)
    for _ in range(20):
        x = torch.tanh(x @ x)
    split.forward_ended()
    split.backward_ended()
    phases = split.finish(duration=100.0, data_wait=None)
    data, fwd, bwd, opt, host, wait, comm = phases
    assert data == 0.0 and fwd > 0 and opt == 0.0 and comm == 0.0
    assert sum(phases) == pytest.approx(100.0)  # the wall time not spent working is the wait


def test_two_ranks_compare_with_the_other_rank_not_a_median_holding_the_straggler():
    # own times 0.1015 and 0.1105 (+8.9 %): against the 2-rank median (their mean) it would be
    # +4.2 %, under the 5 % threshold, and the slow rank would never be named
    ranks = {0: _columns(100, 0.1), 1: _columns(100, 0.109)}
    (named,) = name_stragglers(_windows(ranks), WINDOW)
    assert (named["rank"], named["cause"]) == (1, "compute")
    assert named["slowdown"] == round(0.009 / 0.1015, 4)
    assert named["excess_seconds"]["compute"] == pytest.approx(0.009)


def test_top_compares_each_rank_with_the_median_of_the_others():
    from ddpmon import metrics
    from ddpmon.commands._top_stragglers import straggler_scores

    step, data, part = metrics.STEP_DURATION, metrics.DATA_WAIT, metrics.STEP_PART_SECONDS.name

    def scraped(compute: float) -> dict:  # 100 steps: compute, 1 ms data wait, 10 ms wait
        return {step.sample("count"): 100.0, step.sample("sum"): 100 * (compute + 0.01),
                data.sample("sum"): 0.1, data.sample("count"): 100.0,
                f'{part}{{part="compute"}}': 100 * compute, f'{part}{{part="wait"}}': 1.0}

    scores = straggler_scores({"a": scraped(0.1), "b": scraped(0.109)}, {})
    # own: 0.101 and 0.110 s per step; the 2-rank median would give +4.3 % and no cause
    assert scores["b"]["slowdown"] == pytest.approx(0.009 / 0.101, abs=1e-4)
    assert scores["b"]["cause"] == "compute"
    assert scores["a"]["slowdown"] == pytest.approx(0.101 / 0.11 - 1, abs=1e-4)
    four = straggler_scores({str(i): scraped(0.1) for i in range(3)} | {"s": scraped(0.115)}, {})
    assert four["s"]["slowdown"] == pytest.approx(0.015 / 0.101, abs=1e-4)
    assert four["0"]["slowdown"] == pytest.approx(0.0, abs=1e-9)


def test_top_compares_pipeline_ranks_within_their_stage():
    """2 stages x 2 replicas: stage 1 computes more by design, rank 3 of it 15 % more again;
    stage 0 waits for stage 1 (its bubble). Against the run, rank 2 (not slow) would read
    +20 %; within its stage it reads below 0, and rank 3 is named with its stage."""
    from ddpmon import metrics
    from ddpmon.commands._top_stragglers import cell, straggler_scores
    from ddpmon.export.scrape import stage_key

    step, data, part = metrics.STEP_DURATION, metrics.DATA_WAIT, metrics.STEP_PART_SECONDS.name

    def scraped(compute: float, wait: float, stage: str | None) -> dict:  # 100 steps of 0.2 s
        out = {step.sample("count"): 100.0, step.sample("sum"): 20.0,
               data.sample("sum"): 0.1, data.sample("count"): 100.0,
               f'{part}{{part="compute"}}': 100 * compute, f'{part}{{part="wait"}}': 100 * wait}
        return out | ({stage_key(stage): 1.0} if stage is not None else {})

    ranks = {"0": (0.10, 0.09, "0"), "1": (0.10, 0.09, "0"), "2": (0.13, 0.06, "1"),
             "3": (0.15, 0.04, "1")}
    scores = straggler_scores({t: scraped(*r) for t, r in ranks.items()}, {})
    assert (scores["3"]["cause"], scores["3"]["stage"]) == ("compute", "1")
    assert scores["3"]["slowdown"] == pytest.approx(0.161 / 0.141 - 1, abs=1e-4)
    assert [scores[t]["cause"] for t in "012"] == [None, None, None], scores
    assert scores["0"]["slowdown"] == pytest.approx(0.0, abs=1e-9)
    assert cell(scores["3"]).endswith("compute, stage 1[/]")
    # without stages, the run's ranks against each other: rank 2 would be named too
    flat = straggler_scores({t: scraped(c, w, None) for t, (c, w, _) in ranks.items()}, {})
    assert flat["2"]["cause"] == "compute" and "stage" not in flat["2"]


def test_time_spent_issuing_its_own_collectives_is_cause_communication():
    ranks = {r: _columns(100, 0.1) for r in range(4)}
    for r, cols in ranks.items():
        cols["communication_seconds"] = np.full(100, 0.012 if r == 2 else 0.0002)
    (named,) = name_stragglers(_windows(ranks), WINDOW)
    assert (named["rank"], named["cause"]) == (2, "communication")
    assert named["excess_seconds"]["communication"] == pytest.approx(0.0118)
    del ranks[2]["communication_seconds"]  # a history written before the column: 0
    assert name_stragglers(_windows(ranks), WINDOW) == []


def test_on_cpu_a_stall_inside_the_issue_call_is_communication_not_wait():
    """The slow path to the network: the issue call sleeps (off the CPU); the rest of the wall
    time off the CPU stays the wait for the other ranks."""
    recorder = CollectiveRecorder()
    split = StepSplit(recorder, [torch.zeros(1)])
    split.forward_started()
    split.forward_ended()
    began = recorder.issue.begin()
    time.sleep(0.05)  # inside the issue call
    recorder.issue.end(began)
    split.backward_ended()
    phases = split.finish(duration=1.0, data_wait=None)
    *_, wait, comm = phases
    assert 0.05 <= comm < 0.5 and wait > 0.4
    assert sum(phases) == pytest.approx(1.0)
    split.forward_started()
    assert split.finish(0.1, None)[-1] == 0.0  # taken with its step: the next starts at 0


def test_wall_clock_issue_time_is_taken_out_of_backward(monkeypatch):
    clock = iter([10.0, 12.0, 15.0, 16.0])
    recorder = CollectiveRecorder()
    split = StepSplit(recorder, [torch.zeros(1, device="meta")])
    monkeypatch.setattr(split, "_clock", lambda: next(clock))
    split.forward_started()  # 10
    split.forward_ended()  # 12
    recorder.issue.wall, recorder.issue.runnable = 0.75, 0.01
    recorder.last_issue = 14.0
    split.backward_ended()  # 15: backward 2, of which 1 waiting
    _, fwd, bwd, _, host, wait, comm = split.finish(6.0, data_wait=None)  # now 16
    assert (fwd, bwd, wait, comm) == (2.0, 1.25, 1.0, 0.75)
    assert host == pytest.approx(6.0 - 2.0 - 1.25 - 1.0 - 0.75)


def test_a_pipeline_schedules_step_is_one_call_of_forward_and_backward(monkeypatch):
    """The schedule's step marks the forward's start and the backward's end, nothing between:
    its time is backward (compute), not host."""
    clock = iter([10.0, 14.0, 14.5])
    split = StepSplit(None, [torch.zeros(1, device="meta")])
    monkeypatch.setattr(split, "_clock", lambda: next(clock))
    split.forward_started()  # 10
    split.backward_ended()  # 14
    _, fwd, bwd, _, host, wait, _ = split.finish(5.0, data_wait=None)  # now 14.5
    assert (fwd, bwd, wait) == (0.0, 4.0, 0.0) and host == pytest.approx(1.0)


def test_pipeline_ranks_are_compared_with_their_stage():
    both = {0: "0", 1: "0", 2: "1", 3: "1"}
    assert peer_groups([0, 1, 2, 3], both) == [[0, 1], [2, 3]]
    assert peer_groups([0, 1, 2, 3], {}) == [[0, 1, 2, 3]]
    # one rank per stage: the stages against each other
    assert peer_groups([0, 1], {0: "0", 1: "1"}) == [[0, 1]]
    named = {"rank": 3, "stage": "1", "slowdown": 0.12, "cause": "compute", "since_step": 0,
             "until_step": 39}
    assert describe(named).startswith(
        "stage 1 (rank 3) was 12.0 % slower than its stage's other ranks' median")


def test_an_unseen_backward_end_ends_at_the_optimizer_step(monkeypatch):
    """DeepSpeed's engine: only the forward's start and the engine's step are seen; the time
    between is the step's forward and backward (compute), the engine's step its optimizer."""
    clock = iter([10.0, 13.0, 13.0, 14.0])
    split = StepSplit(None, [torch.zeros(1, device="meta")])
    monkeypatch.setattr(split, "_clock", lambda: next(clock))
    split.forward_started()  # 10
    split.optimizer_started()  # 13: the backward ends here, the optimizer starts
    _, fwd, bwd, opt, host, wait, _ = split.finish(4.0, data_wait=None)  # now 14
    assert (fwd, bwd, opt, wait, host) == (0.0, 3.0, 1.0, 0.0, 0.0)
