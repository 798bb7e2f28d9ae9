"""A DDP module on a subgroup keeps its group under ddpmon (_ddp_subgroup_worker.py):
4 gloo ranks, two data-parallel groups of 2. ddpmon's comm hook replaces DDP's own reduction; it
must reduce over the module's ``process_group`` as DDP does, not the default group. Each rank's
parameters match a reference stepped by hand from its own group's averaged gradients, and
ddpmon's global norm is that group's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel._ddp_subgroup_worker import STEPS
from tests.support.ranks import run_ranks

WORKER = Path(__file__).with_name("_ddp_subgroup_worker.py")


def test_ddp_on_a_subgroup_reduces_over_its_own_group(tmp_path):
    ranks = run_ranks(WORKER, tmp_path, world=4)
    for rank in ranks:
        assert rank["worst"] < 1e-6, rank
        assert len(rank["ours"]) == STEPS
        assert rank["ours"] == pytest.approx(rank["norms"], rel=1e-5)
    # the two groups trained on different data: their norms differ
    assert ranks[0]["norms"] != ranks[2]["norms"]
