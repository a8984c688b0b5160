"""The parameter all-gather in 8 bits (``ShardedOptimizer(..., quantize_param_gather=True)``).

Each rank sends its shard of a bucket as 8-bit codes with an fp32 minimum and step per block of at most
:data:`BLOCK` elements, about a quarter of fp32's bytes (half of bf16's), and every rank -- the owner too -- writes the
dequantized values into the parameters, so that all ranks hold the same model. The owner keeps its exact master
for the update: quantization errors do not accumulate over steps (each step quantizes the exact master afresh).

Blocks never mix two parameters: a shard is cut where a parameter starts or ends (a LayerNorm weight near 1 and
a bias near 1e-3 side by side keep their own scales), and each cut segment into blocks of :data:`BLOCK` from
its start, the last one shorter. Shapes, for one bucket whose shards have ``n`` elements:

* payload -- ``(ShardBlocks.payload_bytes,)`` uint8, the same size on every rank: the ``n`` codes, then per
  block of that rank's shard its minimum and its step (fp32 pairs), then zeros up to the size of the shard with
  the most blocks;
* gathered -- ``(world_size * payload_bytes,)`` uint8: rank r's payload at ``r * payload_bytes``;
* parameters -- ``(world_size * n,)``: the bucket's parameter buffer, rank r's shard at ``r * n``.

Quantization is affine per block, over the block's own range: ``step = (max - min) / 255``, ``code =
round((x - min) * (1 / step))`` in [0, 255], the value ``min + code * step`` in fp32, then the parameter's
dtype. So an element is off by at most half a step of its block, ``(max - min) / 510`` (before the cast to a
16-bit dtype): values clustered away from zero (a LayerNorm weight near 1) keep a fine resolution, which a
scale of ``absmax / 127`` would not give them. A constant block is exact; a block whose range is below
``255 * torch.finfo(torch.float32).tiny`` comes back as its minimum. A NaN or an Inf (or an fp64 value beyond
fp32's range) makes its whole block NaN: the next step's NaN check stops training, as it would unquantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256
_LEVELS = 255.0
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

    @staticmethod
    def of(boundaries: list[int], shard_numel: int, world_size: int, rank: int) -> "ShardBlocks":
        """From the bucket's parameter boundaries (every slot's start and end offset in the bucket buffer)."""
        if shard_numel % 4:
            raise ValueError(f"a quantized shard needs a multiple of 4 elements, got {shard_numel}")
        segments = []
        for r in range(world_size):
            start, end = r * shard_numel, (r + 1) * shard_numel
            cuts = sorted({start, end, *(b for b in boundaries if start < b < end)})
            segments.append(tuple(high - low for low, high in zip(cuts, cuts[1:])))
        payload = shard_numel + 8 * max(_blocks_of(list(lengths)) for lengths in segments)
        return ShardBlocks(rank, shard_numel, tuple(segments), payload)

    def _padded(self, rank: int) -> list[int]:
        """Rank's segments, each rounded up to whole blocks."""
        return [math.ceil(length / BLOCK) * BLOCK for length in self.segments[rank]]

    def encode(self, master: torch.Tensor) -> torch.Tensor:
        """This rank's payload of ``master`` (its shard, 1-D, fp32 or fp64): a new uint8 tensor on its device."""
        n, lengths = self.shard_numel, self.segments[self.rank]
        pieces, first = [], 0
        for length, padded in zip(lengths, self._padded(self.rank)):
            segment = master[first:first + length].float()
            pieces += [segment, segment[-1:].expand(padded - length)]  # (padding that leaves the range alone)
            first += length
        values = torch.cat(pieces).view(-1, BLOCK)  # every segment from a block's start
        low, high = values.amin(dim=1, keepdim=True), values.amax(dim=1, keepdim=True)
        step = (high - low) / _LEVELS
        inverse = torch.where(step >= _TINY, 1 / step, 0.0)  # a constant block (or nearly): codes 0
        codes = torch.mul(values - low, inverse).round_().clamp_(0, _LEVELS).to(torch.uint8).view(-1)
        payload = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=master.device)
        payload[n:n + 8 * len(step)].view(torch.float32).view(-1, 2).copy_(torch.cat([low, step], dim=1))
        payload[:n].copy_(torch.cat(_unpadded(codes, lengths, self._padded(self.rank))))
        return payload

    def decode(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Write every rank's dequantized shard from ``gathered`` into ``out`` (the bucket's parameter buffer)."""
        n = self.shard_numel
        for rank, (payload, shard) in enumerate(zip(gathered.view(-1, self.payload_bytes), out.view(-1, n))):
            shard.copy_(self._values(rank, payload))

    def dequantized(self, master: torch.Tensor) -> torch.Tensor:
        """What this rank's shard of the parameters holds after publishing ``master``: fp32, 1-D."""
        return self._values(self.rank, self.encode(master))

    def _values(self, rank: int, payload: torch.Tensor) -> torch.Tensor:
        n, lengths, padded = self.shard_numel, self.segments[rank], self._padded(rank)
        blocks = sum(padded) // BLOCK
        ranges = payload[n:n + 8 * blocks].clone().view(torch.float32).view(-1, 2)  # (a copy: 4-byte aligned)
        codes, first = [], 0
        for length, rounded in zip(lengths, padded):
            codes += [payload[first:first + length],
                      torch.zeros(rounded - length, dtype=torch.uint8, device=payload.device)]
            first += length
        values = torch.addcmul(ranges[:, :1], torch.cat(codes).view(-1, BLOCK).float(), ranges[:, 1:]).view(-1)
        return torch.cat(_unpadded(values, lengths, padded))


def _unpadded(values: torch.Tensor, lengths: list[int], padded: list[int]) -> list[torch.Tensor]:
    """The segments of ``values`` (laid out padded to whole blocks), without their padding."""
    pieces, first = [], 0
    for length, rounded in zip(lengths, padded):
        pieces.append(values[first:first + length])
        first += rounded
    return pieces
