"""What DDP keeps identical across ranks besides the gradients, for ShardedOptimizer, which replaces it: the parameters
at construction (``init_sync="broadcast"``: :func:`broadcast_parameters`), so that a model initialised differently on
each rank (nanoGPT seeds ``1337 + rank``) trains as one, and the buffers before training forwards
(:class:`BufferBroadcast`), without which running statistics drift apart."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import comm

FLAT_NUMEL = 2 ** 22  # elements a broadcast flattens together at most (16 MiB of fp32), as a bucket holds


class BufferBroadcast:
    """Broadcasts the group's first rank's buffers when DDP's ``broadcast_buffers=True`` would: before the first
    forward and each after a forward with gradients outside ``no_sync()``. ``forward()`` wraps a forward every rank
    runs; ``attach()`` hooks the rule on."""

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
        """Apply the rule to every forward with gradients, until :meth:`remove`. Forwards without (``generate``, maybe
        on one rank) keep each rank's buffers; DDP would broadcast rank 0's."""
        self.handles += [self.module.register_forward_pre_hook(self._before_training_forward),
                         self.module.register_forward_hook(self._after_training_forward)]
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextlib.contextmanager
def no_sync(optimizers: Iterable, buffers: Optional[BufferBroadcast] = None) -> Iterator[None]:
    """DDP's ``no_sync()`` without DDP: every optimizer's ``accumulating()`` and, if given, ``buffers.no_sync()``."""
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(optimizer.accumulating())
        if buffers is not None:
            stack.enter_context(buffers.no_sync())
        yield


def broadcast_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> BufferBroadcast:
    """DDP's ``broadcast_buffers=True`` for ``model`` (:class:`BufferBroadcast`), until ``.remove()``. Call it on every
    rank; around non-final micro-batches, enter its ``no_sync()`` with ``optimizer.accumulating()``."""
    return BufferBroadcast(model, process_group).attach()


@torch.no_grad()
def sync_buffers(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every rank's buffers with the group's first rank's, now. Collective."""
    _overwrite_by_dtype(list(model.buffers()), _broadcaster(process_group))


@torch.no_grad()
def sync_module_states(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every rank's parameters (frozen too) and buffers with the group's first rank's, now, as DDP's
    constructor does; for frameworks that hold the module. Collective."""
    _overwrite_by_dtype([*model.parameters(), *model.buffers()], _broadcaster(process_group))


def _broadcaster(process_group: Optional[dist.ProcessGroup]) -> Callable[[torch.Tensor], None]:
    """In-place broadcast from the group's first rank; on an accelerator the current stream waits, not the host."""
    return lambda flat: comm.broadcast(flat, process_group, name="buffer broadcast").wait()


@torch.no_grad()
def broadcast_parameters(params: Sequence[torch.Tensor], topology, timeout: Optional[float] = None) -> None:
    """Overwrite ``params`` on every rank of ``topology`` (:class:`zeroimpl.topology.Topology`) with the first rank's,
    as DDP does at construction, each broadcast bounded by ``timeout``. Collective. Parameters the collectives
    cannot reach where they are (a CPU model under NCCL) go through the device they reach, a run at a time."""
    def broadcast(flat: torch.Tensor) -> None:
        staged = flat.to(topology.reaching(flat.device))
        for group in topology.groups():
            comm.broadcast(staged, group, timeout,
                           "parameter broadcast at construction (init_sync='broadcast')").wait_on_host()
        if staged is not flat:
            flat.copy_(staged)
    _overwrite_by_dtype(list(params), broadcast)


def _overwrite_by_dtype(tensors: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None]) -> None:
    """``broadcast`` each (dtype, device)'s tensors flattened together in runs of at most ``FLAT_NUMEL`` elements (the
    extra memory this takes), copied back after; a larger contiguous tensor is broadcast in place."""
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor.detach())
    for members in by_dtype.values():
        run, run_numel = [], 0
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
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))
