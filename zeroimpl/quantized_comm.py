"""8-bit payloads for the collectives over slow links: the parameter all-gather (``quantize_param_gather=True``)
and the gradient reduce-scatter (``quantize_grad_reduce=True``).

All-gather: each rank sends the step from its shard of a bucket's parameters, as the last all-gather left them
(``published``), to its exact master -- ``master - published`` -- as 8-bit codes with an fp32 minimum and step
per block of at most :data:`BLOCK` elements, about a quarter of fp32's bytes (half of bf16's), and every rank --
the owner too -- adds every rank's decoded step to that rank's shard, so that all ranks hold the same model. The
error is that of one step's change, not of the weights (each element within half a step of its block of the
change), and it never compounds: the owner steps its exact master, and each all-gather sends everything that
separates the parameters from it, last step's rounding included.

Reduce-scatter (as an all-to-all, :func:`zeroimpl.comm.reduce_scatter_quantized`): each rank sends every other
rank its piece of that rank's gradient shard as a payload on the receiver's blocks; the receiver dequantizes each
piece and sums them in fp32 with its own piece, which never leaves it and stays exact.

Blocks never mix two parameters: a shard is cut where a parameter starts or ends (a LayerNorm weight's change
and a bias's side by side keep their own scales), and each cut segment into blocks of :data:`BLOCK` from its
start, the last one shorter. Shapes, for one bucket whose shards have ``n`` elements:

* payload -- ``(ShardBlocks.payload_bytes,)`` uint8, the same size for every rank's blocks: the ``n`` codes,
  then per block of that rank's shard its range (all-gather: minimum and step, fp32 pairs; reduce-scatter: the
  step, one fp32), then zeros up to the size of the shard with the most blocks;
* gathered (all-gather) -- ``(world_size * payload_bytes,)`` uint8: rank r's payload at ``r * payload_bytes``;
* parameters -- ``(world_size * n,)``: the bucket's parameter buffer, rank r's shard at ``r * n``.

The all-gather's codes are affine per block, over the block's own range: ``step = (max - min) / 255``, ``code =
round((x - min) * (1 / step))`` in [0, 255], the value ``min + code * step`` in fp32. So an element is off by at
most half a step of its block, ``(max - min) / 510``. The reduce-scatter's are symmetric (``signed``): ``step =
absmax / 127``, ``code = round(x / step)`` in [-127, 127], the value ``code * step``: zero and every sign come
back exact (a parameter without a gradient stays without one), an element off by at most ``absmax / 254``. A
constant block is exact; a block whose step is below ``torch.finfo(torch.float32).tiny`` comes back as its
minimum (symmetric: as zeros). A NaN or an Inf (or an fp64 value beyond fp32's range) makes its whole block NaN: the next step's
NaN check stops training, as it would unquantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .layout import ShardLayout

BLOCK = 256
_LEVELS = 255.0
_SIGNED_LEVELS = 127.0
_TINY = torch.finfo(torch.float32).tiny


def _blocks_of(lengths: list[int]) -> int:
    return sum(math.ceil(length / BLOCK) for length in lengths)


@dataclass(frozen=True)
class ShardBlocks:
    """The quantization blocks of every rank's shard of one bucket, for ``rank``'s encoding and everyone's
    decoding. ``segments[r]``: rank r's shard cut at its parameters' boundaries (lengths, summing to
    ``shard_numel``)."""

    rank: int
    shard_numel: int
    segments: tuple[tuple[int, ...], ...]
    payload_bytes: int  # what each rank sends: its codes, and room for the ranges of the shard with the most blocks
    signed: bool = False  # symmetric codes (gradients), else affine (parameters)

    @staticmethod
    def of(boundaries: list[int], shard_numel: int, world_size: int, rank: int,
           signed: bool = False) -> "ShardBlocks":
        """From the bucket's parameter boundaries (every slot's start and end offset in the bucket buffer)."""
        if shard_numel % 4:
            raise ValueError(f"a quantized shard needs a multiple of 4 elements, got {shard_numel}")
        segments = []
        for r in range(world_size):
            start, end = r * shard_numel, (r + 1) * shard_numel
            cuts = sorted({start, end, *(b for b in boundaries if start < b < end)})
            segments.append(tuple(high - low for low, high in zip(cuts, cuts[1:])))
        range_bytes = 4 if signed else 8
        payload = shard_numel + range_bytes * max(_blocks_of(list(lengths)) for lengths in segments)
        return ShardBlocks(rank, shard_numel, tuple(segments), payload, signed)

    def _padded(self, rank: int) -> list[int]:
        """Rank's segments, each rounded up to whole blocks."""
        return [math.ceil(length / BLOCK) * BLOCK for length in self.segments[rank]]

    def encode(self, values: torch.Tensor, rank: Optional[int] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The payload of ``values`` (1-D, ``shard_numel`` elements of any float dtype) on ``rank``'s blocks
        (default: this rank's): its master shard for the all-gather, or its piece of rank r's gradient shard for
        the reduce-scatter. Written into ``out`` (``payload_bytes`` uint8, e.g. this rank's slice of a gather's
        buffer), or a new uint8 tensor on ``values``' device."""
        rank = self.rank if rank is None else rank
        n, lengths = self.shard_numel, self.segments[rank]
        pieces, first = [], 0
        for length, padded in zip(lengths, self._padded(rank)):
            segment = values[first:first + length].float()
            pieces += [segment, segment[-1:].expand(padded - length)]  # (padding that leaves the range alone)
            first += length
        values = torch.cat(pieces).view(-1, BLOCK)  # every segment from a block's start
        if self.signed:
            step = values.abs().amax(dim=1, keepdim=True) / _SIGNED_LEVELS
            ranges, low, (least, most), dtype = step, 0.0, (-_SIGNED_LEVELS, _SIGNED_LEVELS), torch.int8
        else:
            low, high = values.amin(dim=1, keepdim=True), values.amax(dim=1, keepdim=True)
            step = (high - low) / _LEVELS
            ranges, (least, most), dtype = torch.cat([low, step], dim=1), (0, _LEVELS), torch.uint8
        inverse = torch.where(step >= _TINY, 1 / step, 0.0)  # a constant block (or nearly): one code
        codes = torch.mul(values - low, inverse).round_().clamp_(least, most).to(dtype).view(torch.uint8).view(-1)
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=values.device) if out is None else out
        payload[n + 4 * ranges.numel():].zero_()  # (alignment bytes: sent, never read)
        payload[n:n + 4 * ranges.numel()].view(torch.float32).copy_(ranges.view(-1))
        payload[:n].copy_(torch.cat(_unpadded(codes, lengths, self._padded(rank))))
        return payload

    def add_decoded(self, gathered: torch.Tensor, out: torch.Tensor, ranks: Optional[range] = None) -> None:
        """Add each rank's decoded payload in ``gathered`` to its shard of ``out`` (the bucket's parameter
        buffer), in fp32 (or ``out``'s wider dtype), then ``out``'s dtype: the ranks of ``ranks`` (default: all),
        one at a time, each shard written only after its sum is computed (one that raises leaves it as it was)."""
        n, dtype = self.shard_numel, torch.promote_types(out.dtype, torch.float32)
        payloads, shards = gathered.view(-1, self.payload_bytes), out.view(-1, n)
        for rank in range(len(shards)) if ranks is None else ranks:
            shards[rank].copy_(shards[rank].to(dtype) + self.decoded(payloads[rank], rank))

    def decoded(self, payload: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """The values of ``payload``, encoded on ``rank``'s blocks (default: this rank's): fp32, 1-D."""
        rank = self.rank if rank is None else rank
        n, lengths, padded = self.shard_numel, self.segments[rank], self._padded(rank)
        width = 1 if self.signed else 2  # fp32 numbers per block: its step, or its minimum and step
        blocks = sum(padded) // BLOCK
        ranges = payload[n:n + 4 * width * blocks].clone().view(torch.float32).view(-1, width)  # (4-byte aligned)
        codes, first = [], 0
        for length, rounded in zip(lengths, padded):
            codes += [payload[first:first + length],
                      torch.zeros(rounded - length, dtype=torch.uint8, device=payload.device)]
            first += length
        codes = torch.cat(codes).view(-1, BLOCK)
        if self.signed:
            values = torch.mul(codes.view(torch.int8).float(), ranges).view(-1)
        else:
            values = torch.addcmul(ranges[:, :1], codes.float(), ranges[:, 1:]).view(-1)
        return torch.cat(_unpadded(values, lengths, padded))


def _unpadded(values: torch.Tensor, lengths: list[int], padded: list[int]) -> list[torch.Tensor]:
    """The segments of ``values`` (laid out padded to whole blocks), without their padding."""
    pieces, first = [], 0
    for length, rounded in zip(lengths, padded):
        pieces.append(values[first:first + length])
        first += rounded
    return pieces


def reduction_blocks(layout: ShardLayout, quantized: Union[bool, str], rank: int,
                     replica: Optional[tuple[int, int]] = None) -> tuple:
    """Per bucket, the blocks of its 8-bit gradient reduce-scatter (``quantized is True``, world size > 1), and of
    its reduced shard's 8-bit all-reduce across the replicas (``quantized``, hybrid sharding); None for either
    that is not quantized. ``rank``: this rank's in the shard group; ``replica``: ``(this rank's replica, the
    number of replicas)`` under hybrid sharding, ``None`` without a replicate group."""
    if quantized == "replicas" and replica is None:
        raise ValueError("quantize_grad_reduce='replicas' quantizes the all-reduce across the replicas of a 2-D "
                         "device_mesh, and this optimizer has none: pass a (replicate, shard) device_mesh, or "
                         "quantize_grad_reduce=True for the reduce-scatter")
    shard = [ShardBlocks.of(layout.edges(b.index), b.shard_numel, layout.world_size, rank, signed=True)
             for b in layout.buckets] if quantized is True and layout.world_size > 1 else None
    replicas = [_replica_blocks(layout, b.index, rank, *replica) for b in layout.buckets] \
        if quantized and replica is not None else None
    return shard, replicas


def _replica_blocks(layout: ShardLayout, bucket_index: int, rank: int, replica_rank: int,
                    replicas: int) -> ShardBlocks:
    """The blocks of shard ``rank``'s gradient shard of a bucket for its 8-bit all-reduce across the ``replicas``:
    the shard cut into one piece per replica (a multiple of 4 elements each, the last one padded), blocks
    starting at every parameter and at the padding."""
    bucket = layout.buckets[bucket_index]
    start = bucket.shard_range(rank)[0]
    piece = -(-bucket.shard_numel // (4 * replicas)) * 4
    edges = [edge - start for edge in layout.edges(bucket_index) if 0 < edge - start < bucket.shard_numel]
    return ShardBlocks.of(edges + [bucket.shard_numel], piece, replicas, replica_rank, signed=True)
