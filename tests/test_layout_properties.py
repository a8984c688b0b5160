"""Property-based tests of the layout and partition arithmetic (hypothesis): random parameter shapes,
dtypes, param groups, world sizes, bucket caps and alignments.

Properties: every element of every parameter is owned by exactly one rank, at a consistent place (the
invariants of tests/test_layout.py); shards are balanced (every rank owns the same number of slots of each
bucket, and its pieces cover exactly its slots up to the bucket's padding); the fingerprint round-trips;
and real flat buffers give parameter views that hold the original values and shard views that hold
exactly each rank's pieces. Param group 2 is sharded by whole parameters (as Muon's) and groups 3 and 4 are
blocked (a low-bit optimizer's, in blocks of 4 from 12 elements on; group 4 only for whole blocks, as
torchao's), so every property also holds for whole-parameter and blocked buckets and layouts that mix them.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_checks import check_layout_invariants
from zeroimpl.buffers import flatten_params
from zeroimpl.layout import Blocks, ParamSpec, ShardLayout, build_layout

DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}

shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3)  # () is a scalar parameter
params = st.lists(st.tuples(st.integers(0, 4), st.sampled_from(sorted(DTYPES)), shapes), min_size=1, max_size=12)
BLOCKS = {3: Blocks(4, 12), 4: Blocks(4, 12, whole_blocks=True)}
settings_of_layout = st.tuples(st.integers(1, 8), st.integers(1, 300), st.sampled_from([1, 2, 4, 8, 16]))


def _specs(drawn):
    return [ParamSpec(group, dtype, math.prod(shape), whole=group == 2, work=math.prod(shape), blocks=BLOCKS.get(group))
            for group, dtype, shape in drawn]


@settings(max_examples=300, deadline=None)
@given(params, settings_of_layout)
def test_every_element_is_owned_exactly_once_and_shards_are_balanced(drawn, layout_settings):
    world_size, bucket_numel, alignment = layout_settings
    specs = _specs(drawn)
    layout = build_layout(specs, world_size, bucket_numel, alignment)
    check_layout_invariants(specs, layout)
    for bucket in layout.buckets:
        ranges = [bucket.shard_range(rank) for rank in range(world_size)]
        assert all(end - start == bucket.shard_numel for start, end in ranges)  # equal slots per rank
        assert [start for start, _ in ranges] == [rank * bucket.shard_numel for rank in range(world_size)]
    for rank in range(world_size):  # a rank's pieces fill its shard of each bucket up to the padding
        owned = sum(piece.length for piece in layout.pieces(rank))
        assert owned <= layout.shard_numel
        start = [b.shard_range(rank)[0] for b in layout.buckets]
        real = [max(0, min(slot.end, start[slot.bucket_index] + layout.buckets[slot.bucket_index].shard_numel)
                    - max(slot.offset, start[slot.bucket_index])) for slot in layout.slots]
        assert owned == sum(real)
    assert ShardLayout.from_fingerprint(layout.fingerprint()) == layout


@settings(max_examples=60, deadline=None)
@given(params, settings_of_layout, st.randoms(use_true_random=False))
def test_flat_buffers_hold_the_parameters_and_each_rank_shard_holds_its_pieces(drawn, layout_settings, rng):
    world_size, bucket_numel, alignment = layout_settings
    specs = _specs(drawn)
    layout = build_layout(specs, world_size, bucket_numel, alignment)
    generator = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    originals = [torch.randn(shape, generator=generator).to(DTYPES[dtype]) for _, dtype, shape in drawn]
    rank = rng.randrange(world_size)
    model = [torch.nn.Parameter(t.clone()) for t in originals]
    storages = flatten_params(layout, model, rank)
    for param, original in zip(model, originals):
        assert param.shape == original.shape and param.dtype == original.dtype
        assert torch.equal(param.detach(), original)
    for storage in storages:  # each parameter is a view of its bucket's buffer; the padding is zero
        bucket = storage.bucket
        for index, param in zip(bucket.param_indices, storage.params):
            slot = layout.slots[index]
            assert param.data_ptr() == storage.param_buffer[slot.offset:].data_ptr()
        assert not any(storage.param_buffer[start:end].any() for start, end in layout.padding(bucket.index))
    for piece in layout.pieces(rank):
        shard = storages[piece.bucket_index].shard
        held = shard[piece.shard_offset:piece.shard_offset + piece.length]
        assert torch.equal(held, originals[piece.param_index].flatten()[piece.param_start:piece.param_end])
