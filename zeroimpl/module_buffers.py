"""What DDP keeps identical across ranks besides the gradients: the parameters at construction, the buffers
before every training forward.

ShardedOptimizer replaces DistributedDataParallel, and DDP does two more things than reduce gradients. At
construction it broadcasts rank 0's parameters and buffers, so that a model initialised differently on each
rank (nanoGPT seeds every rank ``1337 + rank``) trains as one model: ShardedOptimizer does the same for the
parameters it is given (``init_sync="broadcast"``, its default; :func:`broadcast_parameters`). And with
``broadcast_buffers=True`` (its default) DDP broadcasts rank 0's buffers at the start of every forward run
with gradients enabled, so that every rank normalises with the same running statistics. Without that, each
rank updates its buffers from its own micro-batches only and the ranks' models drift apart.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import comm

FLAT_NUMEL = 2 ** 22  # elements a broadcast flattens together at most (16 MiB of fp32), as a bucket holds


def broadcast_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> RemovableHandle:
    """Broadcast ``model``'s buffers from the group's first rank before every forward with gradients enabled
    (training, as DDP's ``broadcast_buffers=True``); ``handle.remove()`` stops it. Call it on every rank.

    Floating and integer buffers alike (BatchNorm's ``num_batches_tracked`` too), one broadcast per dtype (per
    ``FLAT_NUMEL`` elements of it).
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
    _overwrite_by_dtype(list(model.buffers()), _broadcaster(process_group))


@torch.no_grad()
def sync_module_states(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every rank's parameters (frozen ones too) and buffers with those of the group's first rank, as
    DDP's constructor does, now: for frameworks that hold the module (a ShardedOptimizer sees only the parameters
    it is given). Collective."""
    _overwrite_by_dtype([*model.parameters(), *model.buffers()], _broadcaster(process_group))


def _broadcaster(process_group: Optional[dist.ProcessGroup]) -> Callable[[torch.Tensor], None]:
    """A broadcast in place from the group's first rank; on an accelerator the current stream waits for it, not
    the host (it runs before every training forward)."""
    return lambda flat: comm.broadcast(flat, process_group, name="buffer broadcast").wait()


@torch.no_grad()
def broadcast_parameters(params: Sequence[torch.Tensor], topology, timeout: Optional[float] = None) -> None:
    """Overwrite ``params`` on every rank of ``topology`` (a :class:`zeroimpl.topology.Topology`) with the first
    rank's, as DDP does at construction: in runs of at most ``FLAT_NUMEL`` elements per dtype, each broadcast
    bounded by ``timeout``. Collective."""
    _overwrite_by_dtype(list(params), lambda flat: topology.broadcast_from_first_(
        flat, timeout, "parameter broadcast at construction (init_sync='broadcast')"))


def _overwrite_by_dtype(tensors: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None]) -> None:
    """``broadcast`` each (dtype, device)'s tensors, flattened together in runs of at most ``FLAT_NUMEL`` elements
    (the memory this takes beyond the tensors themselves), then copy the result back into them. A contiguous
    tensor of more elements than that is broadcast in place."""
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor.detach())
    for members in by_dtype.values():
        run: list[torch.Tensor] = []
        run_numel = 0
        for tensor in members:
            if tensor.numel() > FLAT_NUMEL and tensor.is_contiguous():
                broadcast(tensor)
                continue
            if run and run_numel + tensor.numel() > FLAT_NUMEL:
                _broadcast_flat(run, broadcast)
                run, run_numel = [], 0
            run.append(tensor)
            run_numel += tensor.numel()
        if run:
            _broadcast_flat(run, broadcast)


def _broadcast_flat(tensors: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None]) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    broadcast(flat)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
