"""Where every trainable element lives: buckets, padding and shard ownership.

Pure integer arithmetic, no tensors and no communication, so that it can be tested exhaustively.

Vocabulary (used by every other module):

* **parameter index** -- position of a trainable parameter in the deduplicated list the optimizer was
  built from (param-group order, then order inside the group).
* **bucket** -- a contiguous run of parameters that share a param group and a dtype. Each bucket owns one
  flat 1-D buffer of ``padded_numel`` elements; parameter ``i`` of the bucket occupies
  ``[offset, offset + numel)`` and the tail ``[numel, padded_numel)`` is zero padding.
* **shard** -- bucket buffers are cut into ``world_size`` equal, contiguous chunks; rank ``r`` owns chunk
  ``r`` of every bucket: ``[r * shard_numel, (r + 1) * shard_numel)``. A parameter may straddle shards.

Invariants (checked by ``tests/test_layout.py``):

* the layout is a function of the parameter list alone -- never of hook order or timing -- so it is
  identical on every rank;
* buckets are filled in reverse parameter order (the order in which backward usually produces
  gradients, as in DDP), never span two param groups or two dtypes, and never split a parameter;
  the buckets of different param groups are interleaved by their position within their group
  (see ``_completion_keys``), because backward and collectives both follow bucket order;
* ``padded_numel`` is the smallest multiple of ``world_size * alignment`` that holds the bucket, so every
  rank owns exactly the same number of elements and the imbalance is bounded by the padding;
* every element of every parameter is owned by exactly one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one trainable parameter."""

    group_index: int  # which param group it belongs to
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    numel: int


def overlap(start: int, end: int, other_start: int, other_end: int) -> Optional[tuple[int, int]]:
    """The common part ``[low, high)`` of the half-open ranges ``[start, end)`` and ``[other_start,
    other_end)``; ``None`` when they share no element."""
    low, high = max(start, other_start), min(end, other_end)
    return (low, high) if low < high else None


def trainable_specs(groups: Sequence[dict]) -> tuple[list, list[ParamSpec]]:
    """The trainable parameters of param groups (``{"params": [...]}``), each once, in group order, and the
    :class:`ParamSpec` of each: what ShardedOptimizer lays out and ``estimate_memory`` predicts alike."""
    trainable, specs, seen = [], [], set()
    for group_index, group in enumerate(groups):
        for param in group["params"]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                trainable.append(param)
                specs.append(ParamSpec(group_index, str(param.dtype), param.numel()))
    return trainable, specs


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``param_index`` lives: elements ``[offset, offset + numel)`` of bucket ``bucket_index``."""

    param_index: int
    bucket_index: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of ``padded_numel`` elements holding ``param_indices`` (in buffer order)."""

    index: int
    group_index: int
    dtype: str
    param_indices: tuple[int, ...]
    numel: int  # elements used by parameters
    padded_numel: int  # multiple of world_size * alignment
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open element range ``[start, end)`` of this bucket owned by ``rank``."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls in one rank's shard of its bucket.

    Elements ``[param_start, param_end)`` of the flattened parameter sit at
    ``[shard_offset, shard_offset + length)`` of the rank's shard.
    """

    param_index: int
    bucket_index: int
    param_start: int
    param_end: int
    shard_offset: int

    @property
    def length(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class ShardLayout:
    """Buckets and slots for one world size. Build it with :func:`build_layout`."""

    world_size: int
    alignment: int
    buckets: tuple[Bucket, ...]
    slots: tuple[ParamSlot, ...]  # indexed by parameter index

    @property
    def numel(self) -> int:
        """Trainable elements, without padding (Ψ)."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        """Elements of all bucket buffers, padding included."""
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns, padding included (identical on every rank)."""
        return sum(b.shard_numel for b in self.buckets)

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Every parameter piece owned by ``rank``, in bucket then buffer order."""
        pieces = []
        for bucket in self.buckets:
            shard_start, shard_end = bucket.shard_range(rank)
            for param_index in bucket.param_indices:
                slot = self.slots[param_index]
                common = overlap(slot.offset, slot.end, shard_start, shard_end)
                if common:
                    start, end = common
                    pieces.append(ShardPiece(param_index, bucket.index, start - slot.offset,
                                             end - slot.offset, start - shard_start))
        return pieces

    def fingerprint(self) -> dict:
        """A small, complete description of the layout: comparable, to refuse state from another layout, and
        enough to rebuild it with :meth:`from_fingerprint` (checkpoints store it)."""
        return {
            "world_size": self.world_size,
            "alignment": self.alignment,
            "buckets": [(b.group_index, b.dtype, b.param_indices, b.numel, b.padded_numel)
                        for b in self.buckets],
            "param_numels": [slot.numel for slot in self.slots],
        }

    @classmethod
    def from_fingerprint(cls, fingerprint: dict) -> "ShardLayout":
        """Rebuild a layout from :meth:`fingerprint`; raises ValueError if the description is inconsistent."""
        world_size, numels = int(fingerprint["world_size"]), [int(n) for n in fingerprint["param_numels"]]
        slots: list = [None] * len(numels)
        buckets = []
        for bucket_index, (group_index, dtype, param_indices, numel, padded_numel) in enumerate(fingerprint["buckets"]):
            offset = 0
            for index in param_indices:
                if slots[index] is not None:
                    raise ValueError(f"parameter {index} is in two buckets")
                slots[index] = ParamSlot(index, bucket_index, offset, numels[index])
                offset += numels[index]
            if offset != numel or padded_numel < numel or padded_numel % world_size:
                raise ValueError(f"bucket {bucket_index} has inconsistent sizes")
            buckets.append(Bucket(bucket_index, group_index, dtype, tuple(param_indices), numel, padded_numel,
                                  world_size))
        if any(slot is None for slot in slots):
            raise ValueError("a parameter is in no bucket")
        return cls(world_size, int(fingerprint["alignment"]), tuple(buckets), tuple(slots))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _completion_keys(params: Sequence[ParamSpec]) -> list[float]:
    """For each parameter, the fraction of its param group's elements at or behind it in the list.

    Param groups usually list the model's parameters in model order, each group a subsequence of it
    (e.g. decayed matrices, then undecayed biases and norms). A bucket is complete once its earliest
    parameter has its gradient, so it completes at about that parameter's fraction. Ordering buckets by
    it interleaves the groups' buckets the way backward fills them, so that bucket-order launching
    overlaps communication with backward instead of waiting for a small group that spans the whole model.
    """
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
    """Pack ``params`` into buckets of at most ``bucket_numel`` elements (a larger parameter gets a
    bucket of its own) and pad each bucket to a multiple of ``world_size * alignment``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1 or alignment < 1:
        raise ValueError(f"bucket_numel and alignment must be >= 1, got {bucket_numel}, {alignment}")

    groups: list[list[int]] = []  # parameter indices per bucket, in buffer order
    current_key = None
    current_numel = 0
    for index in reversed(range(len(params))):
        spec = params[index]
        key = (spec.group_index, spec.dtype)
        full = current_numel > 0 and current_numel + spec.numel > bucket_numel
        if not groups or key != current_key or full:
            groups.append([])
            current_key, current_numel = key, 0
        groups[-1].append(index)
        current_numel += spec.numel
    completion = _completion_keys(params)
    groups.sort(key=lambda members: (completion[min(members)], params[min(members)].group_index, -min(members)))

    buckets, slots = [], [None] * len(params)
    for bucket_index, members in enumerate(groups):
        offset = 0
        for index in members:
            slots[index] = ParamSlot(index, bucket_index, offset, params[index].numel)
            offset += params[index].numel
        first = params[members[0]]
        buckets.append(Bucket(
            index=bucket_index, group_index=first.group_index, dtype=first.dtype,
            param_indices=tuple(members), numel=offset,
            padded_numel=_round_up(max(offset, 1), world_size * alignment), world_size=world_size))
    return ShardLayout(world_size, alignment, tuple(buckets), tuple(slots))
