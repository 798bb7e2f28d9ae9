"""forensics.stragglers on hand-built step parts, and the agent's step split (agent.step_split)
on hand-made clocks: which rank is named, why, from which step, and what is not named."""

from __future__ import annotations

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
    rank_windows,
)


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
    data, fwd, bwd, opt, host, wait = split.finish(7.0, data_wait=0.25)  # now 16
    assert (data, fwd, bwd, opt, wait) == (0.25, 2.0, 1.5, 0.5, 1.5)
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
    data, fwd, bwd, opt, host, wait = phases
    assert data == 0.0 and fwd > 0 and opt == 0.0
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
