"""Quantization blocks of low-bit optimizers, and where the members of a blocked bucket go so that every piece
of a parameter is stepped as that part of the whole parameter would be. Pure integer arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Blocks:
    """How a low-bit optimizer stores a tensor's state: quantized in blocks of ``size`` elements counted from
    its first element when it has at least ``threshold`` elements (and, ``whole_blocks``, a multiple of
    ``size``: torchao), else in fp32, element by element (bitsandbytes' ``min_8bit_size``)."""

    size: int
    threshold: int
    whole_blocks: bool = False

    def quantizes(self, numel: int) -> bool:
        return numel >= self.threshold and (not self.whole_blocks or numel % self.size == 0)


def place_blocked(sizes: Sequence[int], blocks: Blocks, world_size: int, alignment: int) -> tuple[list[int], int]:
    """Offsets of the members (of ``sizes`` elements, in buffer order) of a blocked bucket, and its padded size.

    Every member starts on a block and the shard size is a multiple of the block (and of ``alignment``), so
    a piece of a member is whole blocks of it (but for the member's own last block). A member is placed at
    the first offset, from the end of the previous one, where each of its pieces has its quantization
    (``blocks.quantizes`` of the piece's size equals that of the member's): bitsandbytes and torchao decide a
    tensor's state by its size, so a piece of a quantized member must not fall under the threshold, nor a
    piece of an fp32 one rise to it. The shard size grows from the least that holds the members (doubling
    its slack, then bisecting) until every member finds such an offset, and is at most one that holds them
    all, each in one piece (a bucket of a few parameters under ``world_size`` thresholds: one rank owns each).
    """
    unit = math.lcm(blocks.size, alignment)
    one_shard = round_up(max(1, sum(round_up(n, blocks.size) for n in sizes)), unit)  # holds every member whole
    low = round_up(-(-one_shard // world_size), unit)
    high, slack = low, 0
    while (offsets := _try_blocked(sizes, blocks, world_size, high)) is None:
        low, slack = high + unit, max(unit, 2 * slack)
        high = min(low - unit + slack, one_shard)
    while low < high:  # the least shard size between the last that failed and one that fits, by bisection
        middle = low + (high - low) // unit // 2 * unit
        found = _try_blocked(sizes, blocks, world_size, middle)
        if found is None:
            low = middle + unit
        else:
            high, offsets = middle, found
    return offsets, world_size * high


def _try_blocked(sizes: Sequence[int], blocks: Blocks, world_size: int, shard: int) -> Optional[list[int]]:
    """Greedy placement for :func:`place_blocked` with this shard size; ``None`` if a member finds no offset."""
    end, offsets = world_size * shard, []
    tries = -(-blocks.threshold // blocks.size) + 1  # offsets tried past each start: enough to grow a piece over it
    position = 0
    for numel in sizes:
        start = round_up(position, blocks.size)
        starts = [start] + [boundary for boundary in range(round_up(start + 1, shard), end, shard)]
        found = next((offset for first in starts for offset in range(first, first + tries * blocks.size, blocks.size)
                      if offset + numel <= end and _pieces_keep_quantization(offset, numel, shard, blocks)), None)
        if found is None:
            return None
        offsets.append(found)
        position = found + numel
    return offsets


def _pieces_keep_quantization(offset: int, numel: int, shard: int, blocks: Blocks) -> bool:
    """Whether every piece of a member at ``offset`` (shards of ``shard`` elements) is quantized as it is."""
    cuts = range(round_up(offset + 1, shard), offset + numel, shard)
    if not cuts:
        return True
    edges = [offset, *cuts, offset + numel]
    whole = blocks.quantizes(numel)
    return all(blocks.quantizes(high - low) == whole for low, high in zip(edges, edges[1:]))

