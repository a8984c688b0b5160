"""Module buffers (BatchNorm's running statistics, ...) kept identical across ranks, as DDP keeps them.

ShardedOptimizer replaces DistributedDataParallel, and DDP does one more thing than reduce gradients: with
``broadcast_buffers=True`` (its default) it broadcasts rank 0's buffers at the start of every forward run
with gradients enabled, so that every rank normalises with the same running statistics. Without that, each
rank updates its buffers from its own micro-batches only and the ranks' models drift apart.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import shutdown


def broadcast_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> RemovableHandle:
    """Broadcast ``model``'s buffers from the group's first rank before every forward with gradients enabled
    (training, as DDP's ``broadcast_buffers=True``); ``handle.remove()`` stops it. Call it on every rank.

    Floating and integer buffers alike (BatchNorm's ``num_batches_tracked`` too), one broadcast per dtype.
    Forwards under ``torch.no_grad()`` (evaluation) do not broadcast, as with DDP. One difference: DDP also
    skips the broadcast on the forward that follows a ``no_sync()`` one (so with gradient accumulation it
    broadcasts once per optimizer step); this broadcasts before every such forward.
    """
    def before_forward(module: torch.nn.Module, args) -> None:
        if torch.is_grad_enabled():
            sync_buffers(module, process_group)

    return model.register_forward_pre_hook(before_forward)


@torch.no_grad()
def sync_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every rank's buffers with those of the group's first rank, now. Collective."""
    source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=source, group=process_group)
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
        if flat.device.type == "cpu":
            shutdown.handed_to_gloo(flat)  # gloo's worker thread may let go of it last
