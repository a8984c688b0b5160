"""8-bit payloads, about a quarter of fp32's bytes, for the parameter all-gather (``quantize_param_gather=True``) and
the gradient reduce-scatter (``quantize_grad_reduce=True``). All-gather: each rank sends ``master - published`` for its
shard (``published``: the parameters as last all-gathered); every rank, the owner too, adds each rank's decoded step to
that rank's shard, so all ranks hold the same model, and the error never compounds. Reduce-scatter (an all-to-all): the
receiver sums the decoded pieces of its shard in fp32 with its own piece, which stays exact.

Blocks of :data:`BLOCK` never mix two parameters (each parameter's part of a shard is cut from its start, the last block
shorter). A bucket's payload is ``(payload_bytes,)`` uint8 on every rank: the shard's ``n`` codes, each block's fp32
range, zeros up to the shard with the most blocks; the gathered buffer holds rank r's at ``r * payload_bytes``, the
parameters rank r's shard at ``r * n``. Codes are affine for the all-gather (``min + code * step``,
``step = (max - min) / 255``), symmetric for the reduce-scatter (``code * step``, ``step = absmax / 127``: zeros and
signs exact); each value decodes within half a step. A NaN or Inf (or an fp64 value beyond fp32's range) makes its whole
block NaN, which the next step's NaN check stops on, as it would unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .layout import ShardLayout
from .precision import at_least_fp32

BLOCK = 256
# elements per pass on the CPU: 4 MB of fp32 stays in cache, yet each operation's overhead stays small
CHUNK = 1 << 20
_LEVELS = 255.0
_SIGNED_LEVELS = 127.0
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class _Plan:
    """One rank's blocks as whole stretches, and tails: short last blocks, padded by repeating their last element."""

    blocks: int
    runs: tuple[tuple[int, int, int], ...]  # (start, count, first block) of stretches of whole blocks, merged
    tails: tuple[tuple[int, int, int], ...]  # (start, count, block)
    tail_source: torch.Tensor  # int64 (len(tails) * BLOCK,): per padded tail element, the shard element it reads
    tail_elements: torch.Tensor  # int64: the tails' shard elements, in order
    tail_slots: torch.Tensor  # int64: where each of them sits in the padded tails
    tail_blocks: torch.Tensor  # int64: the tails' block numbers
    tail_rows: torch.Tensor  # int64: the block of each tail element

    @staticmethod
    def of(lengths: tuple[int, ...]) -> "_Plan":
        runs, tails, first, block = [], [], 0, 0
        for length in lengths:
            whole = length // BLOCK * BLOCK
            if whole:
                if runs and runs[-1][0] + runs[-1][1] == first:  # continues the run before: merge
                    runs[-1] = (runs[-1][0], runs[-1][1] + whole, runs[-1][2])
                else:
                    runs.append((first, whole, block))
                block += whole // BLOCK
            if length > whole:
                tails.append((first + whole, length - whole, block))
                block += 1
            first += length
        source = [start + min(i, count - 1) for start, count, _ in tails for i in range(BLOCK)]
        elements = [start + i for start, count, _ in tails for i in range(count)]
        slots = [t * BLOCK + i for t, (_, count, _) in enumerate(tails) for i in range(count)]
        as_index = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return _Plan(block, tuple(runs), tuple(tails), as_index(source), as_index(elements), as_index(slots),
                     as_index([b for _, _, b in tails]), as_index([b for _, count, b in tails for _ in range(count)]))

    def on(self, device: torch.device) -> "_Plan":
        if self.tail_source.device == device:
            return self
        return _Plan(self.blocks, self.runs, self.tails, *(t.to(device) for t in (
            self.tail_source, self.tail_elements, self.tail_slots, self.tail_blocks, self.tail_rows)))

    def chunks(self, device: torch.device):
        """``(start, count, first block)`` of the runs, cut into pieces of at most CHUNK elements on the CPU."""
        for start, count, block in self.runs:
            step = CHUNK if device.type == "cpu" else count
            for offset in range(0, count, step):
                yield start + offset, min(step, count - offset), block + offset // BLOCK

    def scratch(self, device: torch.device) -> torch.Tensor:
        """fp32 room for the largest of :meth:`chunks` (on an accelerator, of the runs)."""
        return torch.empty(max((count for _, count, _ in self.chunks(device)), default=0), dtype=torch.float32,
                           device=device)


@dataclass(frozen=True)
class ShardBlocks:
    """The quantization blocks of every rank's shard of one bucket, for ``rank``'s encoding and everyone's decoding.
    ``segments[r]``: rank r's shard cut at its parameters' boundaries (lengths summing to ``shard_numel``)."""

    rank: int
    shard_numel: int
    segments: tuple[tuple[int, ...], ...]
    payload_bytes: int  # what each rank sends: its codes, and room for the ranges of the shard with the most blocks
    signed: bool = False  # symmetric codes (gradients), else affine (parameters)
    plans: dict = field(default_factory=dict, compare=False, repr=False)  # (rank, device) -> _Plan

    @staticmethod
    def of(boundaries: list[int], shard_numel: int, world_size: int, rank: int, signed: bool = False) -> "ShardBlocks":
        """From the bucket's parameter boundaries; ``shard_numel % 4 == 0`` keeps the fp32 ranges aligned."""
        if shard_numel % 4:
            raise ValueError(f"a quantized shard needs a multiple of 4 elements, got {shard_numel}")
        segments = []
        for r in range(world_size):
            start, end = r * shard_numel, (r + 1) * shard_numel
            cuts = sorted({start, end, *(b for b in boundaries if start < b < end)})
            segments.append(tuple(high - low for low, high in zip(cuts, cuts[1:])))
        range_bytes = 4 if signed else 8
        payload = shard_numel + range_bytes * max(sum(-(-n // BLOCK) for n in lengths) for lengths in segments)
        return ShardBlocks(rank, shard_numel, tuple(segments), payload, signed)

    def _plan(self, rank: Optional[int], device: torch.device) -> _Plan:
        rank = self.rank if rank is None else rank
        if (rank, device) not in self.plans:
            cpu = self.plans.get((rank, torch.device("cpu"))) or _Plan.of(self.segments[rank])
            self.plans[rank, device] = cpu.on(device)
        return self.plans[rank, device]

    def encode(self, values: torch.Tensor, rank: Optional[int] = None, out: Optional[torch.Tensor] = None,
               minus: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The payload of ``values`` (1-D, ``shard_numel``, any float dtype) on ``rank``'s (default: own) blocks, in
        ``out`` or a new tensor; given ``minus`` (the parameters as last published), of ``values - minus``."""
        device, n = values.device, self.shard_numel
        plan = self._plan(rank, device)
        width, dtype = (1, torch.int8) if self.signed else (2, torch.uint8)
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=device) if out is None else out
        payload[n + 4 * width * plan.blocks:].zero_()  # (alignment bytes: sent, never read)
        ranges = payload[n:n + 4 * width * plan.blocks].view(torch.float32).view(-1, width)
        codes = payload[:n].view(dtype)
        scratch = plan.scratch(device)
        tails = _difference(values[plan.tail_source], None if minus is None else minus[plan.tail_source], None)
        for start, count, block in plan.chunks(device):
            rows = _difference(values[start:start + count], None if minus is None else minus[start:start + count],
                               scratch[:count])
            self._encode_rows(rows.view(-1, BLOCK), ranges[block:block + count // BLOCK], codes[start:start + count],
                              scratch[:count].view(-1, BLOCK))
        if plan.tails:
            tail_ranges = torch.empty(len(plan.tails), width, dtype=torch.float32, device=device)
            tail_codes = torch.empty_like(tails, dtype=dtype)
            self._encode_rows(tails.view(-1, BLOCK), tail_ranges, tail_codes, None)
            ranges.index_copy_(0, plan.tail_blocks, tail_ranges)
            codes.index_copy_(0, plan.tail_elements, tail_codes[plan.tail_slots])
        return payload

    def _encode_rows(self, rows: torch.Tensor, ranges: torch.Tensor, codes: torch.Tensor,
                     scratch: Optional[torch.Tensor]) -> None:
        """``rows`` (``(k, BLOCK)`` fp32) -> ``ranges`` (``(k, 1)`` step, or ``(k, 2)`` minimum and step) and ``codes``;
        ``scratch`` (may be ``rows``) holds the scaled values. amin and amax: aminmax is 10x slower on the CPU."""
        low, high = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
        if self.signed:
            # (abs of both: the largest magnitude, +0 for a block of zeros, where maximum(high, -low) may be -0)
            step = torch.maximum(high.abs_(), low.abs_()).div_(_SIGNED_LEVELS)
            ranges.copy_(step)
            scaled = rows
        else:
            step = (high - low).div_(_LEVELS)
            ranges[:, :1].copy_(low)
            ranges[:, 1:].copy_(step)
            scaled = torch.sub(rows, low, out=scratch)
        inverse = torch.where(step >= _TINY, 1 / step, 0.0)  # a constant block (or nearly): one code
        codes.copy_(torch.mul(scaled, inverse, out=scratch).round_().view(-1))

    def add_decoded(self, gathered: torch.Tensor, out: torch.Tensor, ranks: Optional[range] = None) -> None:
        """Add each rank's decoded payload to its shard of ``out`` (fp32 or wider); writes once all is allocated."""
        payloads, shards = gathered.view(-1, self.payload_bytes), out.view(-1, self.shard_numel)
        for rank in range(len(shards)) if ranks is None else ranks:
            if shards[rank].dtype == torch.float32:  # in place, a chunk at a time
                self.accumulate(payloads[rank], shards[rank], rank)
            else:
                shards[rank].copy_(shards[rank].to(at_least_fp32(out.dtype)) + self.decoded(payloads[rank], rank))

    def decoded(self, payload: torch.Tensor, rank: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values (fp32, 1-D, into ``out`` if given) of ``payload``, encoded on ``rank``'s (default: own) blocks."""
        values = torch.empty(self.shard_numel, dtype=torch.float32, device=payload.device) if out is None else out
        self._decode(payload, rank, values, accumulate=False)
        return values

    def accumulate(self, payload: torch.Tensor, total: torch.Tensor, rank: Optional[int] = None) -> None:
        """Add :meth:`decoded` values to ``total`` (1-D fp32), allocating all it needs before writing ``total``."""
        self._decode(payload, rank, total, accumulate=True)

    def _decode(self, payload: torch.Tensor, rank: Optional[int], into: torch.Tensor, accumulate: bool) -> None:
        device, n = payload.device, self.shard_numel
        plan = self._plan(rank, device)
        width = 1 if self.signed else 2  # fp32 numbers per block: its step, or its minimum and step
        ranges = payload[n:n + 4 * width * plan.blocks].clone().view(torch.float32).view(-1, width)  # (4-byte aligned)
        low, step = (None, ranges) if self.signed else (ranges[:, :1], ranges[:, 1:])
        codes = payload[:n].view(torch.int8 if self.signed else torch.uint8)
        # allocate everything before ``into`` is first written (a failed allocation leaves it unchanged)
        scratch = plan.scratch(device)
        tail_values = None
        if plan.tails:
            tail_values = torch.empty(len(plan.tail_elements), dtype=torch.float32, device=device)
            _dequantize(codes[plan.tail_elements], None if low is None else low[plan.tail_rows, 0],
                        step[plan.tail_rows, 0], tail_values, False, None)
        for start, count, block in plan.chunks(device):
            blocks = slice(block, block + count // BLOCK)
            _dequantize(codes[start:start + count].view(-1, BLOCK), None if low is None else low[blocks], step[blocks],
                        into[start:start + count].view(-1, BLOCK), accumulate, scratch[:count].view(-1, BLOCK))
        if tail_values is not None:
            (into.index_add_ if accumulate else into.index_copy_)(0, plan.tail_elements, tail_values)


def _difference(values: torch.Tensor, minus: Optional[torch.Tensor], scratch: Optional[torch.Tensor]) -> torch.Tensor:
    """``values - minus`` (or ``values``) in fp32: in ``scratch`` when given and needed, else ``values`` if fp32."""
    if minus is not None:
        return torch.sub(values, minus, out=scratch) if scratch is not None else torch.sub(values, minus).float()
    if values.dtype == torch.float32:
        return values
    return scratch.copy_(values) if scratch is not None else values.float()


def _dequantize(codes: torch.Tensor, low: Optional[torch.Tensor], step: torch.Tensor, into: torch.Tensor,
                accumulate: bool, scratch: Optional[torch.Tensor]) -> None:
    """``into`` (+)= ``low + codes * step`` (or ``codes * step``) row by row, an added value rounded to fp32 first."""
    wide = codes.to(torch.float32) if scratch is None else scratch.copy_(codes)
    if accumulate:
        into.add_(wide.mul_(step) if low is None else torch.addcmul(low, wide, step, out=wide))
    elif low is None:
        torch.mul(wide, step, out=into)
    else:
        torch.addcmul(low, wide, step, out=into)


def reduction_blocks(layout: ShardLayout, quantized: Union[bool, str], rank: int,
                     replica: Optional[tuple[int, int]] = None) -> tuple:
    """Per bucket, the blocks of its 8-bit reduce-scatter (``quantized is True``, world size > 1) and of its shard's
    8-bit all-reduce across replicas (``replica``: ``(index, count)``); None where not quantized."""
    if quantized == "replicas" and replica is None:
        raise ValueError("quantize_grad_reduce='replicas' quantizes the all-reduce across the replicas of a 2-D "
                         "device_mesh, and this optimizer has none: pass a (replicate, shard) device_mesh, or "
                         "quantize_grad_reduce=True for the reduce-scatter")
    shard = [ShardBlocks.of(layout.edges(b.index), b.shard_numel, layout.world_size, rank, signed=True)
             for b in layout.buckets] if quantized is True and layout.world_size > 1 else None
    replicas = [_replica_blocks(layout, b.index, rank, *replica) for b in layout.buckets] \
        if quantized and replica is not None else None
    return shard, replicas


def _replica_blocks(layout: ShardLayout, bucket_index: int, rank: int, replica_rank: int, replicas: int) -> ShardBlocks:
    """Blocks of shard ``rank``'s gradient for its 8-bit all-reduce: a piece per replica, a multiple of 4 long."""
    bucket = layout.buckets[bucket_index]
    start = bucket.shard_range(rank)[0]
    piece = -(-bucket.shard_numel // (4 * replicas)) * 4
    edges = [edge - start for edge in layout.edges(bucket_index) if 0 < edge - start < bucket.shard_numel]
    return ShardBlocks.of(edges + [bucket.shard_numel], piece, replicas, replica_rank, signed=True)
