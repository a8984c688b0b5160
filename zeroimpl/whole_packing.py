"""Whole-parameter buckets: how a run of whole parameters is cut into buckets and each bucket's members are
bin-packed into one chunk per rank (each parameter in one shard), the chunks handed to the ranks so as to
balance their step work. Pure integer arithmetic, used by :func:`zeroimpl.layout.build_layout`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .blocks import round_up

if TYPE_CHECKING:
    from .layout import ParamSpec

# whole-parameter buckets: a bucket is closed once it holds bucket_numel elements and its chunks are padded by
# at most this fraction of its elements, or, whatever its padding, once it holds WHOLE_BUCKET_GROWTH times
# world_size * max(bucket_numel, its largest parameter) elements
WHOLE_PADDING_TARGET = 0.01
WHOLE_BUCKET_GROWTH = 2


def pack_whole(members: Sequence[int], params: Sequence[ParamSpec], world_size: int) -> list[list[int]]:
    """Longest-processing-time bin packing of whole parameters into ``world_size`` chunks by numel (the
    padding is ``world_size * fullest - total``): largest first, each into the least full chunk (ties: the
    lower chunk). Members keep their order inside a chunk."""
    chunks: list[list[int]] = [[] for _ in range(world_size)]
    fill = [0] * world_size
    for index in sorted(members, key=lambda i: (-params[i].numel, members.index(i))):
        target = min(range(world_size), key=lambda r: (fill[r], r))
        chunks[target].append(index)
        fill[target] += params[index].numel
    order = {index: position for position, index in enumerate(members)}
    return [sorted(chunk, key=order.__getitem__) for chunk in chunks]


def _chunk_padding(members: Sequence[int], params: Sequence[ParamSpec], world_size: int) -> int:
    fill = [sum(params[i].numel for i in chunk) for chunk in pack_whole(members, params, world_size)]
    return world_size * max(fill) - sum(fill)


def split_whole_run(run: Sequence[int], params: Sequence[ParamSpec], world_size: int,
                     bucket_numel: int) -> list[list[int]]:
    """Cut a run of whole parameters (reverse parameter order, one group and dtype) into buckets.

    From each start, the bucket grows one parameter at a time; it is cut at the first length that holds
    ``bucket_numel`` elements and packs with padding at most :data:`WHOLE_PADDING_TARGET` of them, else, once
    it holds ``WHOLE_BUCKET_GROWTH * world_size * max(bucket_numel, largest member)`` elements, at the length
    (holding ``bucket_numel``) of least relative padding seen. The run's tail may be smaller.
    """
    buckets, start = [], 0
    while start < len(run):
        best_end, best_fraction, total, largest = len(run), float("inf"), 0, 0
        for end in range(start + 1, len(run) + 1):
            total += params[run[end - 1]].numel
            largest = max(largest, params[run[end - 1]].numel)
            if total < bucket_numel and end < len(run):
                continue
            fraction = _chunk_padding(run[start:end], params, world_size) / max(total, 1)
            if fraction < best_fraction:
                best_end, best_fraction = end, fraction
            limit = WHOLE_BUCKET_GROWTH * world_size * max(bucket_numel, largest)
            if fraction <= WHOLE_PADDING_TARGET or total >= limit:
                break
        buckets.append(list(run[start:best_end]))
        start = best_end
    return buckets


def place_whole(members: list[int], params: Sequence[ParamSpec], world_size: int, alignment: int,
                 rank_work: list[int]) -> tuple[list[int], list[int], int]:
    """Members in buffer order, their offsets and the padded size of a whole-parameter bucket. The chunks are
    handed to the ranks heaviest work first, each to the rank with the least work so far (``rank_work``,
    updated)."""
    chunks = pack_whole(members, params, world_size)
    shard_numel = round_up(max(1, max(sum(params[i].numel for i in chunk) for chunk in chunks)), alignment)
    work = [sum(params[i].work for i in chunk) for chunk in chunks]
    by_rank: list[list[int]] = [[] for _ in range(world_size)]
    free = list(range(world_size))
    for chunk_index in sorted(range(world_size), key=lambda c: (-work[c], c)):
        rank = min(free, key=lambda r: (rank_work[r], r))
        free.remove(rank)
        by_rank[rank] = chunks[chunk_index]
        rank_work[rank] += work[chunk_index]
    ordered, offsets = [], []
    for rank, chunk in enumerate(by_rank):
        offset = rank * shard_numel
        for index in chunk:
            ordered.append(index)
            offsets.append(offset)
            offset += params[index].numel
    return ordered, offsets, world_size * shard_numel
