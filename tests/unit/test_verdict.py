"""The verdict line (``forensics.verdict``) for each kind of first failure, from the events the
timeline merged: the layer, and the evidence it rests on."""

import pytest

from ddpmon.forensics.verdict import LAYERS, verdict


def mismatch(rank=2, step=200, ranks=(2,), replicas=4, attempt=0, first_check=False):
    return {"kind": "replica_mismatch", "rank": rank, "step": step, "ranks": list(ranks),
            "group": "encoder", "replicas": replicas, "device": "cuda:2", "attempt": attempt,
            "first_check": first_check}


def steps(rank, *numbers, attempt=0):
    return [{"kind": "step", "rank": rank, "step": n, "attempt": attempt} for n in numbers]


def test_a_lone_divergence_suspects_the_device():
    first = mismatch()
    v = verdict(first, [*steps(2, 99, 100, 199, 200), first])
    assert v["layer"] == "hardware"
    assert v["line"] == ("hardware (suspect rank 2 (cuda:2): silent data corruption; replicas "
                         "diverged at step 200 in encoder)")


def test_a_step_the_rank_skipped_alone_since_the_last_check_is_the_loop():
    first = mismatch(rank=1, ranks=(1,))
    events = [*steps(1, 100, 200), {"kind": "step_skipped", "rank": 1, "step": 170},
              {"kind": "step_skipped", "rank": 0, "step": 180}, first]
    v = verdict(first, events)
    assert v["layer"] == "numerics" and "rank 1 alone skipped step 170" in v["evidence"]
    # a skip before an earlier mismatch of the same rank is not this one's cause
    earlier = mismatch(rank=1, step=100, ranks=(1,))
    v = verdict(first, [{"kind": "step_skipped", "rank": 1, "step": 90}, earlier, *steps(1, 150),
                        first])
    assert v["layer"] == "hardware"


def test_other_weights_from_an_attempts_first_step_and_an_undecided_group():
    first = mismatch(step=30, attempt=1, first_check=True)
    v = verdict(first, [*steps(2, 0, 10, attempt=0), *steps(2, 30, 31, attempt=1), first])
    assert v["layer"] == "numerics" and "another checkpoint" in v["evidence"]
    everyone = mismatch(ranks=(0, 1, 2, 3))
    v = verdict(everyone, [*steps(2, 100, 200), everyone])
    assert "non-deterministic kernel" in v["evidence"]
    pair = mismatch(ranks=(0, 2), replicas=2)
    v = verdict(pair, [*steps(2, 100, 200), pair])
    assert v["layer"] == "hardware" and "no majority, rank 0 differs too" in v["evidence"]


@pytest.mark.parametrize(("first", "layer", "words"), [
    ({"kind": "nonfinite", "rank": 1, "step": 60, "param": "encoder.w", "nonfinite": "nan",
      "origin": True}, "numerics", "nan first on rank 1, step 60, in encoder.w"),
    ({"kind": "oom", "rank": 3, "step": 9}, "memory", "out of memory on rank 3, step 9"),
    ({"kind": "stall", "rank": 0, "step": 5, "phase": "data"}, "data", "waited for its batch"),
    ({"kind": "stall", "rank": 0, "step": 5, "phase": "backward"}, "communication",
     "stopped making progress in backward"),
    ({"kind": "vanished", "rank": 2, "step": 7}, "communication", "rank 2 vanished at step 7"),
    ({"kind": "signal", "rank": 1, "step": 70, "signal": "SIGSEGV", "frame": "train.py:42"},
     "process", "SIGSEGV on rank 1, step 70 in train.py:42"),
    ({"kind": "exit", "rank": 0, "step": 3, "exc_type": "ValueError", "class": "origin"},
     "process", "ValueError on rank 0, step 3"),
])
def test_each_kind_of_first_failure_has_its_layer(first, layer, words):
    v = verdict(first, [first])
    assert v["layer"] == layer and words in v["evidence"] and layer in LAYERS


def test_no_failure_no_verdict():
    assert verdict(None, []) is None
