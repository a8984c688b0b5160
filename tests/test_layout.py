"""The layout arithmetic, with plain integers (no processes)."""

import random

import pytest

from layout_checks import check_layout_invariants
from zeroimpl.layout import ParamSpec, build_layout
from zeroimpl.layout import overlap


def _specs(numels, group=0, dtype="torch.float32"):
    return [ParamSpec(group, dtype, n) for n in numels]


def test_reverse_order_and_bucket_cap():
    layout = build_layout(_specs([10, 20, 30, 40]), world_size=2, bucket_numel=60, alignment=1)
    assert [b.param_indices for b in layout.buckets] == [(3,), (2, 1, 0)]
    assert [b.padded_numel for b in layout.buckets] == [40, 60]


def test_buckets_never_span_groups_or_dtypes():
    specs = [ParamSpec(0, "torch.float32", 4), ParamSpec(0, "torch.bfloat16", 4), ParamSpec(1, "torch.float32", 4)]
    layout = build_layout(specs, world_size=2, bucket_numel=100)
    assert [b.param_indices for b in layout.buckets] == [(1,), (0,), (2,)]  # see _completion_keys


def test_more_ranks_than_elements():
    specs = _specs([1, 2])
    layout = build_layout(specs, world_size=8, bucket_numel=100, alignment=1)
    assert layout.buckets[0].padded_numel == 8 and layout.buckets[0].shard_numel == 1
    check_layout_invariants(specs, layout)
    assert layout.pieces(5) == []  # ranks past the data own only padding


def test_equal_inputs_give_equal_layouts():
    specs = _specs([7, 300, 5, 1, 64])
    assert build_layout(specs, 3, 128) == build_layout(list(specs), 3, 128)


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts_keep_invariants(seed):
    rng = random.Random(seed)
    count = rng.randrange(1, 25)
    groups = sorted(rng.randrange(3) for _ in range(count))  # params arrive group by group
    specs = [ParamSpec(group, rng.choice(["torch.float32", "torch.bfloat16"]),
                       rng.choice([0, 1, 3, rng.randrange(1, 5000)])) for group in groups]
    layout = build_layout(specs, world_size=rng.randrange(1, 9), bucket_numel=rng.choice([1, 64, 1000, 10 ** 6]),
                          alignment=rng.choice([1, 4, 8]))
    check_layout_invariants(specs, layout)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        build_layout(_specs([1]), world_size=0, bucket_numel=1)


def test_groups_are_interleaved_in_expected_backward_order():
    """Decay group (big matrices of layers 0..2) then no-decay group (their biases): the biases' bucket
    completes only when layer 0's bias arrives, so it goes last; the matrices go in reverse order."""
    specs = _specs([100, 100, 100], group=0) + _specs([4, 4, 4], group=1)
    layout = build_layout(specs, world_size=2, bucket_numel=100, alignment=1)
    assert [b.param_indices for b in layout.buckets] == [(2,), (1,), (0,), (5, 4, 3)]
    assert [layout.slots[i].bucket_index for i in range(6)] == [2, 1, 0, 3, 3, 3]


# -- in process --------------------------------------------------------------------------------------------------
def test_overlap_of_half_open_ranges():
    assert overlap(0, 10, 5, 20) == (5, 10)
    assert overlap(5, 20, 0, 10) == (5, 10)
    assert overlap(0, 5, 5, 10) is None  # touching is not overlapping
    assert overlap(3, 4, 0, 100) == (3, 4)
