"""Assertions shared by the layout tests (tests/test_layout.py, tests/test_layout_properties.py): the
invariants every :class:`zeroimpl.layout.ShardLayout` must keep, checked element by element."""

import math


def check_layout_invariants(specs, layout):
    """Assert the invariants of zeroimpl/layout.py's docstring on ``layout``, built from ``specs``."""
    # every element of every parameter is owned by exactly one rank, at a consistent place
    owned = {i: [0] * spec.numel for i, spec in enumerate(specs)}
    for rank in range(layout.world_size):
        for piece in layout.pieces(rank):
            slot = layout.slots[piece.param_index]
            bucket = layout.buckets[piece.bucket_index]
            shard_start, _ = bucket.shard_range(rank)
            assert shard_start + piece.shard_offset == slot.offset + piece.param_start
            assert 0 <= piece.shard_offset and piece.shard_offset + piece.length <= bucket.shard_numel
            for element in range(piece.param_start, piece.param_end):
                owned[piece.param_index][element] += 1
    assert all(count == 1 for counts in owned.values() for count in counts)
    for bucket in layout.buckets:
        assert bucket.padded_numel % (layout.world_size * layout.alignment) == 0
        if bucket.whole:  # each parameter in one shard; each shard as full as its chunk, plus alignment
            slots = [layout.slots[i] for i in bucket.param_indices]
            assert all(s.offset // bucket.shard_numel == (s.end - 1) // bucket.shard_numel for s in slots if s.numel)
            fill = [sum(s.numel for s in slots if s.numel and s.offset // bucket.shard_numel == r)
                    for r in range(layout.world_size)]
            assert bucket.shard_numel - max(fill) < layout.alignment or bucket.numel == 0
            assert len({specs[i].group_index for i in bucket.param_indices}) == 1
            continue
        if bucket.block:  # every member on a block, shards of whole blocks, pieces quantized as their parameter
            blocks = specs[bucket.param_indices[0]].blocks
            assert bucket.block == blocks.size and bucket.shard_numel % math.lcm(blocks.size, layout.alignment) == 0
            assert all(layout.slots[i].offset % blocks.size == 0 for i in bucket.param_indices)
            for rank in range(layout.world_size):
                for piece in (p for p in layout.pieces(rank) if p.bucket_index == bucket.index):
                    assert piece.param_start % blocks.size == 0
                    numel = specs[piece.param_index].numel
                    assert piece.length == numel or blocks.quantizes(piece.length) == blocks.quantizes(numel)
            one_shard = sum(-(-specs[i].numel // blocks.size) * blocks.size for i in bucket.param_indices)
            assert bucket.shard_numel <= max(1, -(-one_shard // math.lcm(blocks.size, layout.alignment))) * math.lcm(
                blocks.size, layout.alignment)  # at most the shard that holds every member whole
            assert len({specs[i].group_index for i in bucket.param_indices}) == 1
            continue
        # the padding is less than one alignment unit per rank (a bucket of empty parameters still gets one)
        assert bucket.padded_numel - bucket.numel <= layout.world_size * layout.alignment
        assert bucket.padded_numel - bucket.numel < layout.world_size * layout.alignment or bucket.numel == 0
        assert len({specs[i].group_index for i in bucket.param_indices}) == 1
        assert len({specs[i].dtype for i in bucket.param_indices}) == 1
        offsets = [layout.slots[i].offset for i in bucket.param_indices]
        assert offsets == sorted(offsets) and offsets[0] == 0
    assert layout.numel == sum(s.numel for s in specs)
