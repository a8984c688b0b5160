"""What DDP keeps identical across ranks besides the gradients: the parameters at construction, the buffers
before every training forward.

ShardedOptimizer replaces DistributedDataParallel, and DDP does two more things than reduce gradients. At
construction it broadcasts rank 0's parameters and buffers, so that a model initialised differently on each
rank (nanoGPT seeds every rank ``1337 + rank``) trains as one model: ShardedOptimizer does the same for the
parameters it is given (``init_sync="broadcast"``, its default; :func:`broadcast_parameters`). And with
``broadcast_buffers=True`` (its default) DDP broadcasts rank 0's buffers at the start of a forward that follows
one run with gradients outside ``no_sync`` (:class:`BufferBroadcast`, the one rule every route uses), so that
every rank normalises with the same running statistics. Without that, each rank updates its buffers from its
own micro-batches only and the ranks' models drift apart.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import comm

FLAT_NUMEL = 2 ** 22  # elements a broadcast flattens together at most (16 MiB of fp32), as a bucket holds


class BufferBroadcast:
    """Rank 0's buffers broadcast before a forward of ``module`` exactly when
    ``DistributedDataParallel(broadcast_buffers=True)`` broadcasts them (its ``require_forward_param_sync``):
    before the first forward, and before every forward that follows one run with gradients enabled outside
    ``no_sync``. So after a non-final micro-batch of accumulation, or after an evaluation forward, the next forward
    keeps each rank's own buffers, as under DDP. Floating and integer buffers alike (BatchNorm's
    ``num_batches_tracked`` too), one broadcast per dtype (per ``FLAT_NUMEL`` elements of it).

    ``forward()`` brackets one forward of the module, which every rank runs (a framework's training and validation
    steps, as DDP's forward). ``attach()`` registers the rule as hooks on the module itself, which ``remove()``
    takes off. Those hooks see every forward of the module, including ones a single rank runs without DDP's
    wrapper (``generate`` on the main process, an evaluation of the master process alone), which must not
    communicate: so the hooks act on forwards with gradients enabled only, which every rank runs. Among those they
    follow DDP's rule; a forward without gradients neither broadcasts nor changes what comes next (where DDP would
    broadcast rank 0's buffers before an evaluation through its wrapper, each rank evaluates with its own until the
    next training forward). ``no_sync()`` marks the forwards of non-final micro-batches, where DDP's ``no_sync``
    would be entered.
    """

    def __init__(self, module: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None):
        self.module, self.process_group = module, process_group
        self.due = True
        self.accumulating = False
        self.handles: list[RemovableHandle] = []

    def before(self) -> None:
        if self.due:
            sync_buffers(self.module, self.process_group)

    def after(self) -> None:
        self.due = torch.is_grad_enabled() and not self.accumulating

    def _before_training_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.before()

    def _after_training_forward(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self.after()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.before()
        yield
        self.after()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        outer, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = outer

    def attach(self) -> "BufferBroadcast":
        """Run the rule around every forward of the module with gradients enabled (hooks), until :meth:`remove`."""
        self.handles += [self.module.register_forward_pre_hook(self._before_training_forward),
                         self.module.register_forward_hook(self._after_training_forward)]
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextlib.contextmanager
def no_sync(optimizers: Iterable, buffers: Optional[BufferBroadcast] = None) -> Iterator[None]:
    """DDP's ``no_sync()`` without DDP, for non-final micro-batches: every optimizer's ``accumulating()`` (a
    ShardedOptimizer's) and, when given, the buffers' ``no_sync()``."""
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(optimizer.accumulating())
        if buffers is not None:
            stack.enter_context(buffers.no_sync())
        yield


def broadcast_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> BufferBroadcast:
    """Broadcast ``model``'s buffers from the group's first rank before its training forwards as DDP's
    ``broadcast_buffers=True`` does (:class:`BufferBroadcast`'s hooks: forwards without gradients are left alone,
    so one rank may run the model by itself), from now until ``.remove()``. Call it on every rank. Enter the
    returned object's ``no_sync()`` with the optimizer's ``accumulating()`` around non-final micro-batches, where
    DDP's ``no_sync()`` would be."""
    return BufferBroadcast(model, process_group).attach()


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
