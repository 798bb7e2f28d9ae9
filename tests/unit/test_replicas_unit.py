"""The replica checksum and its comparison at world size 1 (the multi-rank faults:
tests/parallel/test_replicas.py): exact and order-independent over every float dtype, changed
by any one flipped bit, and a comparison that names the minority, or everyone without a
majority."""

import pytest
import torch
import torch.distributed as dist

from ddpmon.strategies.replicas import InFlight, bits, checksums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_any_flipped_bit_changes_its_groups_checksum_and_no_other(dtype):
    torch.manual_seed(0)
    params = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(2).to(dtype)]
    group_of = torch.tensor([0, 1, 1])
    before = checksums(params, group_of, 2)
    reordered = checksums([params[0], params[2], params[1]], torch.tensor([0, 1, 1]), 2)
    assert torch.equal(before, reordered)  # the order of the parameters does not matter
    width = params[1].element_size() * 8
    for bit in (0, width // 2, width - 1):  # lowest, a middle one, the sign bit
        flipped = [p.clone() for p in params]
        raw = bits(flipped[1]).view(-1)
        raw[3] ^= (1 << bit) if bit < width - 1 else -(1 << bit)
        after = checksums(flipped, group_of, 2)
        assert after[0] == before[0] and after[1] != before[1], (dtype, bit)


def _compare(rows: list[list[int]], me: int, mesh) -> object:
    """A real completed Work (one-rank all-gather), then the rows the replicas sent."""
    out = torch.empty(1, dtype=torch.int64)
    work = dist.all_gather_into_tensor(out, torch.zeros(1, dtype=torch.int64), async_op=True)
    check = InFlight(step=100, work=work, gathered=torch.tensor(rows), ranks=[4, 5, 6, 7][
        :len(rows)], me=me, group_names=["embed", "blocks", "head"])
    return check.compare()


def test_the_minority_is_named_with_its_first_differing_group(mesh):
    agree = [1, 2, 3]
    assert _compare([agree, agree, agree], 0, mesh) is None
    named = _compare([agree, agree, [1, 9, 9], agree], 2, mesh)
    assert named.ranks == (6,) and named.this_rank and named.group == "blocks"
    assert named.step == 100 and named.replicas == 4
    seen_by_other = _compare([agree, agree, [1, 9, 9], agree], 0, mesh)
    assert seen_by_other.ranks == (6,) and not seen_by_other.this_rank
    assert seen_by_other.group == "blocks"  # the named rank's first differing group


def test_without_a_majority_every_rank_is_named(mesh):
    two = _compare([[1, 2, 3], [1, 2, 4]], 1, mesh)
    assert two.ranks == (4, 5) and two.this_rank and two.group == "head"
    split = _compare([[1, 2, 3], [1, 2, 3], [0, 2, 3], [0, 2, 3]], 0, mesh)
    assert split.ranks == (4, 5, 6, 7) and split.group == "embed"
