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
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .layout import ShardLayout
from .precision import at_least_fp32

BLOCK = 256
# elements encoded or decoded at a time on the CPU: a chunk's passes (its ranges, then its codes) run over 4 MB
# of fp32 in cache, and the chunks are large enough that each operation's own overhead stays small
CHUNK = 1 << 20
_LEVELS = 255.0
_SIGNED_LEVELS = 127.0
_TINY = torch.finfo(torch.float32).tiny


def _blocks_of(lengths: list[int]) -> int:
    return sum(math.ceil(length / BLOCK) for length in lengths)


@dataclass(frozen=True)
class _Plan:
    """How one rank's shard lies on its blocks, for work over whole stretches of it rather than block by block.

    ``runs``: ``(start, count, first block)`` -- stretches of whole blocks (``count`` a multiple of BLOCK),
    neighbours merged, so that ``values[start:start + count].view(-1, BLOCK)`` are blocks ``first block ...``;
    ``tails``: ``(start, count, block)`` of every shorter block (a segment's last, ``0 < count < BLOCK``).
    ``tail_source`` -- ``(len(tails) * BLOCK,)`` int64: per padded tail element the shard element it reads (a
    tail's padding repeats its last element, which leaves its range alone); ``tail_elements`` -- the shard
    elements of the tails, in order; ``tail_slots`` -- where each of them sits in the padded tails;
    ``tail_blocks`` -- the tails' block numbers; ``tail_rows`` -- the block of each tail element."""

    blocks: int
    runs: tuple[tuple[int, int, int], ...]
    tails: tuple[tuple[int, int, int], ...]
    tail_source: torch.Tensor
    tail_elements: torch.Tensor
    tail_slots: torch.Tensor
    tail_blocks: torch.Tensor
    tail_rows: torch.Tensor

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
    """The quantization blocks of every rank's shard of one bucket, for ``rank``'s encoding and everyone's
    decoding. ``segments[r]``: rank r's shard cut at its parameters' boundaries (lengths, summing to
    ``shard_numel``).

    Encoding and decoding run over whole stretches of blocks (:class:`_Plan`), on the CPU a chunk of
    :data:`CHUNK` elements at a time through one scratch buffer; only the short last block of each segment
    goes through an index (all of a shard's at once)."""

    rank: int
    shard_numel: int
    segments: tuple[tuple[int, ...], ...]
    payload_bytes: int  # what each rank sends: its codes, and room for the ranges of the shard with the most blocks
    signed: bool = False  # symmetric codes (gradients), else affine (parameters)
    plans: dict = field(default_factory=dict, compare=False, repr=False)  # (rank, device) -> _Plan

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

    def _plan(self, rank: int, device: torch.device) -> _Plan:
        key = (rank, device)
        if key not in self.plans:
            cpu = self.plans.get((rank, torch.device("cpu"))) or _Plan.of(self.segments[rank])
            self.plans[key] = cpu.on(device)
        return self.plans[key]

    def encode(self, values: torch.Tensor, rank: Optional[int] = None, out: Optional[torch.Tensor] = None,
               minus: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The payload of ``values`` (1-D, ``shard_numel`` elements of any float dtype) on ``rank``'s blocks
        (default: this rank's): its piece of rank r's gradient shard for the reduce-scatter, or -- ``minus``: the
        parameters as last published -- the step from them to the master for the all-gather, ``values - minus``
        taken a chunk at a time. Written into ``out`` (``payload_bytes`` uint8, e.g. this rank's slice of a
        gather's buffer), or a new uint8 tensor on ``values``' device.

        On the CPU a chunk of whole blocks at a time: its difference, its ranges, then its codes, each pass over
        the same few MB in cache."""
        rank = self.rank if rank is None else rank
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
        """Blocks ``rows`` (``(k, BLOCK)`` fp32) -> their ``ranges`` (``(k, 1)`` steps or ``(k, 2)`` minimum and
        step) and ``codes`` (``k * BLOCK``, int8 or uint8); ``scratch`` (``rows``' shape, may be ``rows``): where
        the scaled values go. In finite arithmetic the codes need no clamping: ``rows - low`` is at most the
        block's range and the inverse step its levels over it, so the product rounds to at most the top level.
        (amin and amax, not aminmax: along rows that is 10x slower on the CPU.)"""
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
        """Add each rank's decoded payload in ``gathered`` to its shard of ``out`` (the bucket's parameter
        buffer), in fp32 (or ``out``'s wider dtype), then ``out``'s dtype: the ranks of ``ranks`` (default: all),
        one at a time, each shard written only once everything its sum needs is allocated (one that raises
        leaves it as it was)."""
        n, dtype = self.shard_numel, at_least_fp32(out.dtype)
        payloads, shards = gathered.view(-1, self.payload_bytes), out.view(-1, n)
        for rank in range(len(shards)) if ranks is None else ranks:
            if shards[rank].dtype == torch.float32:  # in place, a chunk at a time
                self.accumulate(payloads[rank], shards[rank], rank)
            else:
                shards[rank].copy_(shards[rank].to(dtype) + self.decoded(payloads[rank], rank))

    def decoded(self, payload: torch.Tensor, rank: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values of ``payload``, encoded on ``rank``'s blocks (default: this rank's): fp32, 1-D, written into
        ``out`` (``shard_numel`` fp32) when given."""
        values = torch.empty(self.shard_numel, dtype=torch.float32, device=payload.device) if out is None else out
        self._decode(payload, rank, values, accumulate=False)
        return values

    def accumulate(self, payload: torch.Tensor, total: torch.Tensor, rank: Optional[int] = None) -> None:
        """``total += `` the values of ``payload`` (as :meth:`decoded` gives them, then added), ``total`` fp32
        (1-D, ``shard_numel``). Everything it needs is allocated before ``total`` is first written."""
        self._decode(payload, rank, total, accumulate=True)

    def _decode(self, payload: torch.Tensor, rank: Optional[int], into: torch.Tensor, accumulate: bool) -> None:
        rank = self.rank if rank is None else rank
        device, n = payload.device, self.shard_numel
        plan = self._plan(rank, device)
        width = 1 if self.signed else 2  # fp32 numbers per block: its step, or its minimum and step
        ranges = payload[n:n + 4 * width * plan.blocks].clone().view(torch.float32).view(-1, width)  # (4-byte aligned)
        low, step = (None, ranges) if self.signed else (ranges[:, :1], ranges[:, 1:])
        codes = payload[:n].view(torch.int8 if self.signed else torch.uint8)
        # everything allocated before ``into`` is first written: the chunks' scratch, and the tails' values
        scratch = plan.scratch(device)
        tail_values = None
        if plan.tails:
            rows = plan.tail_rows
            tail_values = torch.empty(len(plan.tail_elements), dtype=torch.float32, device=device)
            _dequantize(codes[plan.tail_elements], None if low is None else low[rows, 0], step[rows, 0], tail_values,
                        False, None)
        for start, count, block in plan.chunks(device):
            blocks = slice(block, block + count // BLOCK)
            target = into[start:start + count].view(-1, BLOCK)
            _dequantize(codes[start:start + count].view(-1, BLOCK), None if low is None else low[blocks],
                        step[blocks], target, accumulate, scratch[:count].view(-1, BLOCK))
        if tail_values is not None:
            if accumulate:
                into.index_add_(0, plan.tail_elements, tail_values)
            else:
                into.index_copy_(0, plan.tail_elements, tail_values)


def _difference(values: torch.Tensor, minus: Optional[torch.Tensor], scratch: Optional[torch.Tensor]) -> torch.Tensor:
    """``values - minus`` (``values`` without ``minus``) in fp32: in ``scratch`` when given and needed, else
    ``values`` itself when it is fp32, else a new tensor."""
    if minus is not None:
        return torch.sub(values, minus, out=scratch) if scratch is not None else torch.sub(values, minus).float()
    if values.dtype == torch.float32:
        return values
    return scratch.copy_(values) if scratch is not None else values.float()


def _dequantize(codes: torch.Tensor, low: Optional[torch.Tensor], step: torch.Tensor, into: torch.Tensor,
                accumulate: bool, scratch: Optional[torch.Tensor]) -> None:
    """``into`` (+)= ``low + codes * step`` (``low`` None: ``codes * step``), shapes broadcast row by row; added,
    the decoded value is rounded to fp32 first (as :meth:`ShardBlocks.decoded` gives it), then added."""
    wide = codes.to(torch.float32) if scratch is None else scratch.copy_(codes)
    if accumulate:
        decoded = wide.mul_(step) if low is None else torch.addcmul(low, wide, step, out=wide)
        into.add_(decoded)
    elif low is None:
        torch.mul(wide, step, out=into)
    else:
        torch.addcmul(low, wide, step, out=into)


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
