"""What a ShardedOptimizer holds on this rank, in bytes, by kind of tensor."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held on this rank. Tensors are counted once, by what they are, not by who points at them.

    * ``parameters`` -- the flat buffers behind the trainable parameters (padding included).
    * ``gradients`` -- full-size ``param.grad`` tensors of trainable parameters that exist right now
      (stage 1 between backward and step; always 0 in stage 2 outside backward).
    * ``gradient_shard`` -- this rank's averaged gradient shard (reduce dtype).
    * ``master_weights`` -- fp32 copies of this rank's shard; 0 for fp32 models, whose shard is the master.
    * ``optimizer_state`` -- every tensor in the inner optimizer's state (moments, step counters, ...).
    * ``bucket_buffers`` -- gradient bucket buffers alive right now (0 outside backward and step).
    """

    parameters: int
    gradients: int
    gradient_shard: int
    master_weights: int
    optimizer_state: int
    bucket_buffers: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors in ``tensors`` (``None`` and non-tensors are skipped)."""
    seen, total = set(), 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
