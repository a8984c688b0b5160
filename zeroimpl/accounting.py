"""What a ShardedOptimizer holds on this rank, in bytes, by kind of tensor and by where it lives."""

from __future__ import annotations

from dataclasses import asdict, dataclass
import torch


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one memory (the device or the host), by kind. Each tensor is counted once, by what it is.

    * ``parameters`` -- the flat buffers behind the trainable parameters (padding included); with
      ``quantize_param_gather`` also the copy of this rank's shard as the last all-gather left it.
    * ``gradients`` -- full-size ``param.grad`` tensors of trainable parameters that exist right now
      (stage 1 between backward and step; always 0 in stage 2 outside backward).
    * ``gradient_shard`` -- this rank's averaged gradient shard (reduce dtype on the device; fp32 on the
      host with offload, plus a device accumulator while ``accumulating()`` micro-batches are summed).
    * ``master_weights`` -- fp32 copies of this rank's shard; 0 for fp32 models without offload, whose
      shard is the master.
    * ``optimizer_state`` -- every tensor in the inner optimizer's state (moments, step counters, ...).
    * ``bucket_buffers`` -- gradient bucket buffers alive right now (0 outside backward and step); on the
      host (offload of a 16-bit model), the two staging buffers per dtype that the masters are converted
      into on their way to the device (always there).
    """

    parameters: int = 0
    gradients: int = 0
    gradient_shard: int = 0
    master_weights: int = 0
    optimizer_state: int = 0
    bucket_buffers: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held on this rank: ``device`` (the parameters' device -- the CPU when there is no GPU) and
    ``host`` (host memory that CPU offload holds in the device's place; all zero without offload)."""

    device: StateBytes
    host: StateBytes

    @property
    def total(self) -> int:
        return self.device.total + self.host.total

    def as_dict(self) -> dict:
        return {"device": self.device.as_dict(), "host": self.host.as_dict(), "total": self.total}


def stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``tensor``'s memory: itself, or for a tensor subclass that wraps others (torch's
    ``__tensor_flatten__`` protocol: torchao's quantized optimizer state keeps uint8 codes and per-block
    scales in an fp32-looking tensor), the tensors it wraps, recursively."""
    if not hasattr(type(tensor), "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [leaf for name in names for leaf in stored_tensors(getattr(tensor, name))]


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors in ``tensors``, each counted by what it stores (:func:`stored_tensors`;
    ``None`` and non-tensors are skipped)."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for leaf in stored_tensors(tensor):
            if id(leaf) not in seen:
                seen.add(id(leaf))
                total += leaf.numel() * leaf.element_size()
    return total


def memory_report(held: dict[str, list[torch.Tensor]], offload: bool) -> MemoryReport:
    """The report of the tensors ``ShardedOptimizer.held_tensors()`` returns; ``offload``: the masters and the
    optimizer state live on the host."""
    held_bytes = {kind: tensor_bytes(tensors) for kind, tensors in held.items()}
    device = StateBytes(
        parameters=held_bytes["parameters"],
        gradients=held_bytes["gradients"],
        gradient_shard=held_bytes["gradient_shard"],
        master_weights=0 if offload else held_bytes["master_weights"],
        optimizer_state=0 if offload else held_bytes["optimizer_state"],
        bucket_buffers=held_bytes["bucket_buffers"],
    )
    host = StateBytes(gradient_shard=held_bytes["host_gradient_shard"], bucket_buffers=held_bytes["host_staging"],
                      master_weights=held_bytes["master_weights"] if offload else 0,
                      optimizer_state=held_bytes["optimizer_state"] if offload else 0)
    return MemoryReport(device, host)

