"""Where every trainable element lives: buckets, padding and shard ownership, in pure integer arithmetic (no tensors,
no communication), so that it can be tested exhaustively. The vocabulary of every other module:

* **parameter index** -- position in the deduplicated list of trainable parameters, in param-group order.
* **bucket** -- a run of parameters of one param group and dtype, owning one flat 1-D buffer of ``padded_numel``
  elements: each member at ``[offset, offset + numel)``, every other element zero padding.
* **shard** -- rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)`` of every bucket buffer. A *flat* bucket
  packs parameters end to end, so they may straddle shards; a *whole-parameter* one (Muon, Adafactor) bin-packs
  whole parameters into each shard; a *blocked* one (low-bit optimizers: :class:`Blocks`) is flat, but starts each
  parameter on a block and makes each shard whole blocks.

Invariants (``tests/test_layout.py``): the layout is a function of the parameter list alone, never of hook order or
timing, so it is identical on every rank. Buckets are filled in reverse parameter order (as backward usually
produces gradients), never span two param groups or dtypes, never split a parameter (whole-parameter: nor between
shards); different groups' buckets are interleaved by :func:`_completion_keys`. ``padded_numel`` is a multiple of
``world_size * alignment``. Every element is owned by exactly one rank. In a blocked bucket each piece of a split
parameter keeps the whole parameter's quantization (``Blocks.quantizes``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence


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


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one trainable parameter."""

    group_index: int  # which param group it belongs to
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    numel: int
    whole: bool = False  # its optimizer needs it whole: one rank owns all of it
    work: int = 0  # the owner's relative cost of stepping it (whole parameters; balanced across ranks)
    blocks: Optional[Blocks] = None  # its optimizer quantizes state in blocks (a blocked bucket)


def overlap(start: int, end: int, other_start: int, other_end: int) -> Optional[tuple[int, int]]:
    low, high = max(start, other_start), min(end, other_end)
    return (low, high) if low < high else None


def trainable_specs(groups: Sequence[dict], step_work: Sequence[Optional[Callable[[tuple], int]]] = (),
                    blocks: Sequence[Optional[Blocks]] = ()) -> tuple[list, list[ParamSpec]]:
    """The trainable parameters of param groups, each once, in group order, and their :class:`ParamSpec`: what
    ShardedOptimizer lays out and ``estimate_memory`` predicts alike. ``step_work[g]``: group ``g`` is sharded by
    whole parameters, at this cost per parameter shape; ``blocks[g]``: a flat group's low-bit quantization."""
    trainable, specs, seen = [], [], set()
    for group_index, group in enumerate(groups):
        work = step_work[group_index] if group_index < len(step_work) else None
        quantization = blocks[group_index] if group_index < len(blocks) and work is None else None
        for param in group["params"]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                trainable.append(param)
                specs.append(ParamSpec(group_index, str(param.dtype), param.numel(), whole=work is not None,
                                       work=0 if work is None else work(tuple(param.shape)), blocks=quantization))
    return trainable, specs


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``param_index`` lives: elements ``[offset, offset + numel)`` of bucket ``bucket_index``."""

    param_index: int
    bucket_index: int
    offset: int
    numel: int
    end: int = field(init=False)  # offset + numel (a field: read per gradient, it costs no call)

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.offset + self.numel)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: member ``param_indices[k]`` at ``[offsets[k], offsets[k] + its numel)``, the rest padding."""

    index: int
    group_index: int
    dtype: str
    param_indices: tuple[int, ...]
    numel: int  # elements used by parameters
    padded_numel: int  # multiple of world_size * alignment
    world_size: int
    offsets: tuple[int, ...]  # flat: end to end; whole: end to end from each shard's start; blocked: place_blocked
    whole: bool = False  # every shard holds whole parameters
    block: int = 0  # blocked: the quantization block (members start on one; shards are whole blocks); else 0
    shard_numel: int = field(init=False)  # padded_numel // world_size: each rank's shard

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_numel", self.padded_numel // self.world_size)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open element range ``[start, end)`` of this bucket owned by ``rank``."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter in one rank's shard: elements ``[param_start, param_end)`` of the flattened
    parameter sit at ``[shard_offset, shard_offset + length)`` of the shard."""

    param_index: int
    bucket_index: int
    param_start: int
    param_end: int
    shard_offset: int
    length: int = field(init=False)  # param_end - param_start

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", self.param_end - self.param_start)


@dataclass(frozen=True)
class ShardLayout:
    """Buckets and slots for one world size. Build it with :func:`build_layout`."""

    world_size: int
    alignment: int
    buckets: tuple[Bucket, ...]
    slots: tuple[ParamSlot, ...]  # indexed by parameter index

    @property
    def numel(self) -> int:
        """Trainable elements, padding excluded (Ψ)."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        """All buckets' elements, padding included."""
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns, padding included."""
        return sum(b.shard_numel for b in self.buckets)

    def padding(self, bucket_index: int) -> list[tuple[int, int]]:
        """A bucket's ranges ``[start, end)`` that no parameter occupies."""
        bucket = self.buckets[bucket_index]
        slots = sorted((self.slots[i] for i in bucket.param_indices), key=lambda slot: slot.offset)
        ends, starts = [0] + [slot.end for slot in slots], [slot.offset for slot in slots] + [bucket.padded_numel]
        return [(end, start) for end, start in zip(ends, starts) if end < start]  # a member's end to the next start

    def edges(self, bucket_index: int) -> list[int]:
        """Each member's start and end offset in a bucket's buffer."""
        slots = [self.slots[i] for i in self.buckets[bucket_index].param_indices]
        return [edge for slot in slots for edge in (slot.offset, slot.end)]

    def pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces ``rank`` owns, in bucket then buffer order."""
        pieces = []
        for bucket in self.buckets:
            shard_start, shard_end = bucket.shard_range(rank)
            for param_index in bucket.param_indices:
                slot = self.slots[param_index]
                if common := overlap(slot.offset, slot.end, shard_start, shard_end):
                    pieces.append(ShardPiece(param_index, bucket.index, common[0] - slot.offset,
                                             common[1] - slot.offset, common[0] - shard_start))
        return pieces

    def fingerprint(self) -> dict:
        """The layout in brief, stored by checkpoints: to refuse another layout's state and to rebuild it
        (:meth:`from_fingerprint`)."""
        return {
            "world_size": self.world_size,
            "alignment": self.alignment,
            "buckets": [(b.group_index, b.dtype, b.param_indices, b.numel, b.padded_numel)
                        + ((b.offsets,) if b.whole else (b.offsets, b.block) if b.block else ())
                        for b in self.buckets],
            "param_numels": [slot.numel for slot in self.slots],
        }

    @classmethod
    def from_fingerprint(cls, fingerprint: dict) -> "ShardLayout":
        """The layout :meth:`fingerprint` describes; ValueError if inconsistent."""
        world_size, numels = int(fingerprint["world_size"]), [int(n) for n in fingerprint["param_numels"]]
        buckets, slots = [], [None] * len(numels)
        for bucket_index, entry in enumerate(fingerprint["buckets"]):
            group_index, dtype, param_indices, numel, padded_numel = entry[:5]
            whole, block = len(entry) == 6, int(entry[6]) if len(entry) == 7 else 0
            sizes = [numels[i] for i in param_indices]
            offsets = tuple(entry[5]) if len(entry) > 5 else _end_to_end(sizes)
            bucket = Bucket(bucket_index, group_index, dtype, tuple(param_indices), numel, padded_numel, world_size,
                            offsets, whole, block)
            for index, offset in zip(param_indices, offsets):
                if slots[index] is not None:
                    raise ValueError(f"parameter {index} is in two buckets")
                slots[index] = ParamSlot(index, bucket_index, offset, numels[index])
            if (len(offsets) != len(sizes) or sum(sizes) != numel or padded_numel % world_size
                    or not _fits(bucket, sizes)):
                raise ValueError(f"bucket {bucket_index} has inconsistent sizes")
            buckets.append(bucket)
        if any(slot is None for slot in slots):
            raise ValueError("a parameter is in no bucket")
        return cls(world_size, int(fingerprint["alignment"]), tuple(buckets), tuple(slots))


def _fits(bucket: Bucket, sizes: Sequence[int]) -> bool:
    ranges = sorted((offset, offset + size) for offset, size in zip(bucket.offsets, sizes))
    inside = all(0 <= start and end <= bucket.padded_numel for start, end in ranges)
    disjoint = all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    one_shard = not bucket.whole or all(start // bucket.shard_numel == (end - 1) // bucket.shard_numel
                                        for start, end in ranges if end > start)
    on_blocks = not bucket.block or (bucket.shard_numel % bucket.block == 0
                                     and all(offset % bucket.block == 0 for offset in bucket.offsets))
    return inside and disjoint and one_shard and on_blocks


def _end_to_end(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(sizes, initial=0))[:-1] if sizes else ()


def _completion_keys(params: Sequence[ParamSpec]) -> list[float]:
    """Per parameter, the fraction of its group's elements at or behind it: about when in backward a bucket whose
    earliest member it is completes. Buckets ordered by it interleave the groups as backward fills them, so that
    bucket-order launching overlaps backward instead of waiting for a small group that spans the whole model."""
    group_numel: dict[int, int] = {}
    for spec in params:
        group_numel[spec.group_index] = group_numel.get(spec.group_index, 0) + spec.numel
    behind, keys = dict.fromkeys(group_numel, 0), [0.0] * len(params)
    for index in reversed(range(len(params))):
        group = params[index].group_index
        behind[group] += params[index].numel
        keys[index] = behind[group] / (group_numel[group] or 1)
    return keys


def build_layout(params: Sequence[ParamSpec], world_size: int, bucket_numel: int,
                 alignment: int = 8) -> ShardLayout:
    """Pack ``params`` (by parameter index) into buckets padded to multiples of ``world_size * alignment``. A flat or
    blocked bucket holds at most ``bucket_numel`` elements, or one larger parameter; a whole-parameter one grows
    until its shards pack with little padding, balancing the ranks' ``work``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1 or alignment < 1:
        raise ValueError(f"bucket_numel and alignment must be >= 1, got {bucket_numel}, {alignment}")

    groups: list[list[int]] = []  # parameter indices per bucket, in reverse parameter order
    runs = [list(run) for _, run in itertools.groupby(  # maximal runs of one group, dtype and kind, in reverse order
        reversed(range(len(params))), key=lambda index: (params[index].group_index, params[index].dtype))]
    for run in runs:
        if params[run[0]].whole:
            groups += split_whole_run(run, params, world_size, bucket_numel)
            continue
        groups.append([])
        numel = 0  # of the bucket being filled
        for index in run:
            if numel > 0 and numel + params[index].numel > bucket_numel:
                groups.append([])
                numel = 0
            groups[-1].append(index)
            numel += params[index].numel
    completion = _completion_keys(params)
    groups.sort(key=lambda members: (completion[min(members)], params[min(members)].group_index, -min(members)))

    buckets, slots = [], [None] * len(params)
    rank_work = [0] * world_size
    for bucket_index, members in enumerate(groups):
        first = params[members[0]]
        sizes = [params[i].numel for i in members]
        if first.whole:
            members, offsets, padded = place_whole(members, params, world_size, alignment, rank_work)
        elif first.blocks is not None:
            offsets, padded = place_blocked(sizes, first.blocks, world_size, alignment)
        else:
            offsets, padded = _end_to_end(sizes), round_up(max(sum(sizes), 1), world_size * alignment)
        for index, offset in zip(members, offsets):
            slots[index] = ParamSlot(index, bucket_index, offset, params[index].numel)
        buckets.append(Bucket(
            index=bucket_index, group_index=first.group_index, dtype=first.dtype, param_indices=tuple(members),
            numel=sum(params[i].numel for i in members), padded_numel=padded, world_size=world_size,
            offsets=tuple(offsets), whole=first.whole, block=first.blocks.size if first.blocks else 0))
    return ShardLayout(world_size, alignment, tuple(buckets), tuple(slots))


WHOLE_PADDING_TARGET = 0.01
WHOLE_BUCKET_GROWTH = 2


def pack_whole(members: Sequence[int], params: Sequence[ParamSpec], world_size: int) -> list[list[int]]:
    """Longest-processing-time bin packing of ``members`` into ``world_size`` chunks by numel: largest first, each
    into the least full chunk (ties: the lower). Members keep their order inside a chunk."""
    chunks: list[list[int]] = [[] for _ in range(world_size)]
    fill = [0] * world_size
    for index in sorted(members, key=lambda i: (-params[i].numel, members.index(i))):
        target = min(range(world_size), key=lambda r: (fill[r], r))
        chunks[target].append(index)
        fill[target] += params[index].numel
    order = {index: position for position, index in enumerate(members)}
    return [sorted(chunk, key=order.__getitem__) for chunk in chunks]


def split_whole_run(run: Sequence[int], params: Sequence[ParamSpec], world_size: int,
                     bucket_numel: int) -> list[list[int]]:
    """Cut a run of whole parameters (reverse parameter order, one group and dtype) into buckets. A bucket grows one
    parameter at a time and is cut at the first length that holds ``bucket_numel`` elements with padding at most
    :data:`WHOLE_PADDING_TARGET` of them; failing that, once it holds ``WHOLE_BUCKET_GROWTH * world_size *
    max(bucket_numel, largest member)`` elements, at the length of least relative padding seen."""
    buckets, start = [], 0
    while start < len(run):
        best_end, best_fraction, total, largest = len(run), float("inf"), 0, 0
        for end in range(start + 1, len(run) + 1):
            total += params[run[end - 1]].numel
            largest = max(largest, params[run[end - 1]].numel)
            if total < bucket_numel and end < len(run):
                continue
            fill = [sum(params[i].numel for i in chunk) for chunk in pack_whole(run[start:end], params, world_size)]
            fraction = (world_size * max(fill) - sum(fill)) / max(total, 1)
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
    """A whole-parameter bucket's members in buffer order, their offsets, and its padded size. Chunks go to the
    ranks heaviest first, each to the free rank with the least work so far (``rank_work``, updated in place)."""
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
    offsets = [rank * shard_numel + offset for rank, chunk in enumerate(by_rank)
               for offset in _end_to_end([params[i].numel for i in chunk])]
    return [index for chunk in by_rank for index in chunk], offsets, world_size * shard_numel


def place_blocked(sizes: Sequence[int], blocks: Blocks, world_size: int, alignment: int) -> tuple[list[int], int]:
    """Offsets of a blocked bucket's members (of ``sizes`` elements, in buffer order), and its padded size. Each member
    goes at the first block start past the previous one where every piece of it is quantized as it is (:class:`Blocks`).
    The shard size, a multiple of the block and of ``alignment``, grows from the least that holds the members (doubling
    its slack, then bisecting) until every member finds one; at most it holds all members whole (one rank owns each)."""
    unit = math.lcm(blocks.size, alignment)
    one_shard = round_up(max(1, sum(round_up(n, blocks.size) for n in sizes)), unit)  # holds every member whole
    low = round_up(-(-one_shard // world_size), unit)
    high, slack = low, 0
    while (offsets := _try_blocked(sizes, blocks, world_size, high)) is None:
        low, slack = high + unit, max(unit, 2 * slack)
        high = min(low - unit + slack, one_shard)
    while low < high:  # the least shard size between the last that failed and one that fits, by bisection
        middle = low + (high - low) // unit // 2 * unit
        if (found := _try_blocked(sizes, blocks, world_size, middle)) is None:
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
    edges = [offset, *range(round_up(offset + 1, shard), offset + numel, shard), offset + numel]
    whole = blocks.quantizes(numel)
    return all(blocks.quantizes(high - low) == whole for low, high in zip(edges, edges[1:]))

