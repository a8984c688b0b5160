"""The parameter all-gather in int8 (``ShardedOptimizer(..., quantize_param_gather=True)``).

Each rank sends its shard of a bucket as int8 codes with one fp32 scale per block of :data:`BLOCK` elements,
about a quarter of fp32's bytes (half of bf16's), and every rank -- the owner too -- writes the dequantized
values into the parameters, so that all ranks hold the same model. The owner keeps its exact master for the
update: quantization errors do not accumulate over steps (each step quantizes the exact master afresh).

Shapes, for a shard of ``n`` elements (``n`` a multiple of the layout's alignment: 4-byte aligned scales):

* payload -- ``(payload_bytes(n),)`` uint8: the ``n`` codes (int8), then ``ceil(n / BLOCK)`` fp32 scales;
* gathered -- ``(world_size * payload_bytes(n),)`` uint8: rank r's payload at ``r * payload_bytes(n)``;
* parameters -- ``(world_size * n,)``: the bucket's parameter buffer, rank r's shard at ``r * n``.

Quantization is symmetric per block: ``scale = absmax / 127``, ``code = round(x * (1 / scale))`` in [-127, 127]
(a block of zeros: scale 0, codes 0); the value is ``code * scale`` in fp32, then the parameter's dtype. So an
element is off by at most half a step of its block, ``absmax / 254`` (before the cast to a 16-bit dtype).
"""

from __future__ import annotations

import math

import torch

BLOCK = 256
_LEVELS = 127.0


def payload_bytes(shard_numel: int) -> int:
    """Bytes one rank sends for a shard of ``shard_numel`` elements."""
    return shard_numel + 4 * math.ceil(shard_numel / BLOCK)


def _blocks(values: torch.Tensor) -> list[torch.Tensor]:
    """``values`` (1-D) as its whole blocks ``(k, BLOCK)`` and, if any, the last partial block ``(1, rest)``."""
    whole = values.numel() // BLOCK * BLOCK
    parts = [values[:whole].view(-1, BLOCK)]
    if whole < values.numel():
        parts.append(values[whole:].view(1, -1))
    return parts


def encode(master: torch.Tensor) -> torch.Tensor:
    """The payload of ``master`` (1-D, fp32 or fp64): a new uint8 tensor on its device."""
    n = master.numel()
    if n % 4:
        raise ValueError(f"a quantized shard needs a multiple of 4 elements, got {n} (the layout's alignment)")
    payload = torch.empty(payload_bytes(n), dtype=torch.uint8, device=master.device)
    codes, scales = _blocks(payload[:n].view(torch.int8)), payload[n:].view(torch.float32)
    first = 0
    for block_codes, values in zip(codes, _blocks(master.float())):
        scale = values.abs().amax(dim=1, keepdim=True) / _LEVELS
        inverse = torch.where(scale > 0, 1 / scale, 0.0)  # (a block of zeros: codes 0)
        block_codes.copy_(torch.mul(values, inverse).round_().clamp_(-_LEVELS, _LEVELS))
        scales[first:first + len(scale)] = scale.view(-1)
        first += len(scale)
    return payload


def decode(gathered: torch.Tensor, world_size: int, out: torch.Tensor) -> None:
    """Write every rank's dequantized shard from ``gathered`` into ``out`` (the parameter buffer), one shard at a
    time (a temporary of one shard in fp32)."""
    n = out.numel() // world_size
    for payload, shard in zip(gathered.view(world_size, payload_bytes(n)), out.view(world_size, n)):
        scales = payload[n:].clone().view(torch.float32)  # (a copy: a view of bytes must start 4-byte aligned)
        first = 0
        for codes, values in zip(_blocks(payload[:n].view(torch.int8)), _blocks(shard)):
            torch.mul(codes, scales[first:first + len(codes), None], out=values)
            first += len(codes)
