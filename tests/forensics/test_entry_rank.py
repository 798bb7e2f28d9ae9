"""The rank a NaN entered on under tensor parallel (forensics/entry.py): when every rank of a TP
group flags the same step as its origin, the timeline names the rank whose NaN entered nearest
the loss (``entry_depth``), whatever order the ranks wrote their events in; where the entries
cannot tell, ``tied_ranks`` says which ranks it could not tell apart."""

from __future__ import annotations

import json

import pytest

from ddpmon.forensics.timeline import build_timeline


def _write(run, rank, events):
    run.mkdir(parents=True, exist_ok=True)
    with open(run / f"events.rank{rank}.jsonl", "a") as fh:
        fh.write(json.dumps({"rank": rank, "step": None, "ts": 1.0, "kind": "start",
                             "world_size": 2}) + "\n")
        for e in events:
            fh.write(json.dumps({"rank": rank, **e}) + "\n")


def _nan(ts, step=3, **fields):
    return {"ts": ts, "step": step, "kind": "nonfinite", "origin": True, "nonfinite": "nan",
            "param": "layers.3.feed_forward.w2.weight", **fields}


@pytest.mark.parametrize("rank0_first", [True, False])
def test_the_rank_whose_entry_is_nearest_the_loss_is_named_whoever_wrote_first(
        tmp_path, rank0_first):
    early, late = (5.0, 5.2) if rank0_first else (5.2, 5.0)
    _write(tmp_path, 0, [_nan(early, entry="layers.2", entry_depth=3)])
    _write(tmp_path, 1, [_nan(late, entry="layers.3", entry_depth=2)])
    ff = build_timeline(tmp_path).first_failure
    assert (ff["rank"], ff["step"], ff["class"], ff["entry"]) == (1, 3, "origin", "layers.3")
    assert "tied_ranks" not in ff


def test_equal_entries_are_a_tie_named_with_its_ranks(tmp_path):
    _write(tmp_path, 0, [_nan(5.0, entry="layers.3", entry_depth=2)])
    _write(tmp_path, 1, [_nan(5.1, entry="layers.3", entry_depth=2)])
    ff = build_timeline(tmp_path).first_failure
    assert ff["rank"] == 0 and ff["tied_ranks"] == [0, 1]


def test_a_rank_without_an_entry_makes_it_a_tie(tmp_path):
    # rank 1's NaN reached no block output it could see: the entries cannot order the two
    _write(tmp_path, 0, [_nan(5.0)])
    _write(tmp_path, 1, [_nan(5.1, entry="layers.0", entry_depth=5)])
    ff = build_timeline(tmp_path).first_failure
    assert ff["rank"] == 0 and ff["tied_ranks"] == [0, 1]


def test_only_the_same_step_and_origins_are_compared(tmp_path):
    # a later step's nearer entry and a consequence do not displace the first origin
    _write(tmp_path, 0, [_nan(5.0, step=3, entry="layers.1", entry_depth=4)])
    _write(tmp_path, 1, [_nan(6.0, step=4, entry="layers.3", entry_depth=0),
                         {**_nan(5.5, step=3, entry="layers.3", entry_depth=0), "origin": False}])
    ff = build_timeline(tmp_path).first_failure
    assert (ff["rank"], ff["step"], ff["entry"]) == (0, 3, "layers.1")
    assert "tied_ranks" not in ff


def test_without_entries_the_order_is_by_time_as_before(tmp_path):
    _write(tmp_path, 0, [_nan(5.2)])
    _write(tmp_path, 1, [_nan(5.0)])
    ff = build_timeline(tmp_path).first_failure
    assert ff["rank"] == 1 and "tied_ranks" not in ff and "entry" not in ff
