"""Collective timing through ``ddpmon.attach`` on real gloo ranks: FSDP2 (2 ranks), HSDP and
FSDP2+TP (4 ranks). The user installs counting FSDP2 comms before attach; ddpmon's per-op
counts must equal them (and the notes' one reduce-scatter per unit per step), every timing is
positive and shorter than the mean step, bytes are counted, and no other op appears."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.parallel._attach_worker import SCALER_STEPS
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_attach_worker.py")
DURATION = "ddpmon_collective_duration_seconds"
BYTES = "ddpmon_collective_bytes_total"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "rank")))
            out[(s.name, labels)] = s.value
    return out


def _per_op(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["op"]: v for (n, labels), v in samples.items() if n == name}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(strategy: str, n: int) -> list[dict]:
        if strategy not in cache:
            out = tmp_path_factory.mktemp(strategy.replace("+", "_"))
            results = run_ranks(WORKER, out, ["--collectives", "--strategy", strategy], world=n)
            for rank in results:
                rank["samples"] = _samples((out / f"rank{rank['rank']}.metrics").read_text())
            cache[strategy] = results
        return cache[strategy]

    return get


@pytest.mark.parametrize(
    ("strategy", "ranks", "ops"),
    [
        ("fsdp2", 2, {"reduce_scatter", "all_gather"}),
        ("hsdp", 4, {"reduce_scatter", "all_gather", "all_reduce"}),
        ("fsdp2+tp", 4, {"reduce_scatter", "all_gather"}),
    ],
)
def test_collectives_are_counted_timed_and_plausible(runs, strategy, ranks, ops):
    for rank in runs(strategy, ranks):
        s, counts = rank["samples"], rank["counts"]
        count = _per_op(s, f"{DURATION}_count")
        total = _per_op(s, f"{DURATION}_sum")
        nbytes = _per_op(s, BYTES)
        assert set(count) == set(nbytes) == ops, (strategy, count)  # nothing else exported
        # The notes: one reduce-scatter per FSDP2 unit per step (units: 2 blocks + the root).
        assert count["reduce_scatter"] == counts["units"] * SCALER_STEPS == 3 * SCALER_STEPS
        for op in ops:
            assert count[op] == counts[op] > 0, (op, count, counts)  # the user's own count
            assert nbytes[op] > 0
        step_mean = s[("ddpmon_step_duration_seconds_sum", ())] / s[
            ("ddpmon_step_duration_seconds_count", ())
        ]
        for op in ops:
            mean = total[op] / count[op]
            assert 0 < mean < step_mean, (op, mean, step_mean)
        assert s[("ddpmon_agent_errors_total", (("probe", "comm"),))] == 0
        # The run's strategy, and the exported norms still right with the timing wrappers in.
        info = [labels for (n, labels) in s if n == "ddpmon_rank_info"]
        assert dict(info[0])["strategy"] == strategy
        for step in rank["steps"]:
            assert step["grad_norm"] == pytest.approx(step["reference"], rel=1e-5)
