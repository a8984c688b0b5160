"""The parameter all-gathers left in flight after ``step()`` (``overlap_param_gather``), and the guards that make every
read of a parameter see the new values or wait for them (or raise where its all-gather failed:
:class:`zeroimpl.pending.Pending`); results are bitwise those of ``overlap_param_gather=False``. What each guard sees
and misses: docs/advanced.md.

* A :class:`~torch.overrides.TorchFunctionMode` at the bottom of the mode stack of the thread that called ``step()``
  waits for the buckets whose parameter buffer a tensor argument aliases (all, if a storage cannot be read).
* A global module forward pre-hook, on any thread, waits for the module's own buckets, and for all before a TorchScript
  or ``torch.compile`` module, whose code runs below the mode (with ``fullgraph=True``: :data:`COMPILED_READ`).
* On CUDA the reading stream waits, then the default stream and ``step()``'s wait for it.

Other reads need ``finish_param_gathers()`` first (the integrations call it at one seam each); zeroimpl's own work on
its own tensors runs under :func:`guards_lifted`. Why a mode, not Megatron's module pre-hooks alone: reads outside a
forward (an EMA, ``p.data.clamp_()``) would see the previous step's values, or be overwritten when the gather lands. Why
torch's private stack calls: a user's ``with mode:`` block spanning ``step()`` pops the top of the stack on exit, where
a mode pushed the public way would be. A guard taken off the stack goes to :mod:`zeroimpl.shutdown` (a gloo work issued
meanwhile may hold it).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from typing import Iterable, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import shutdown
from .pending import Pending

_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.storage_offset, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device, torch.Tensor.__hash__,
    torch.Tensor.data_ptr,
})
_WHOLE_MODULES = ("RecursiveScriptModule", "TopLevelTracedModule", "OptimizedModule")  # code below the mode
COMPILED_READ = ("a function compiled with torch.compile(fullgraph=True) ran while ShardedOptimizer's parameter "
                 "all-gathers were in flight (overlap_param_gather): the guard that waits for them runs outside "
                 "compiled code. Call optimizer.finish_param_gathers() before it, compile it without fullgraph=True, "
                 "or construct the optimizer with overlap_param_gather=False")
_EVERY = weakref.WeakSet()  # every optimizer's InFlightGathers in this process (guards_lifted)
_COLLECTOR = [None]  # the thread the garbage collector runs on: its finalizers (abandon) may run inside a torch call
gc.callbacks.append(lambda phase, info: _COLLECTOR.__setitem__(0, threading.get_ident() if phase == "start" else None))


class BucketGather(NamedTuple):
    """One bucket's all-gather in flight: its wait and, if quantized, the payloads it lands from."""

    pending: Pending
    payloads: Optional[torch.Tensor] = None


class InFlightGathers:
    """One optimizer's gathers in flight, by bucket; while any is, the mode is on the stack and the hook registered."""

    def __init__(self) -> None:
        self._pending: dict[int, BucketGather] = {}
        self._bucket_of_storage: dict[int, int] = {}  # data_ptr of a parameter buffer's storage -> bucket index
        self._bucket_of_param: dict[int, int] = {}  # id(parameter) -> bucket index
        self._guard: Optional[_Guard] = None
        self._hook = None
        self._thread: Optional[int] = None  # the thread whose mode stack holds the guard
        self._device: Optional[torch.device] = None  # the parameter buffers' device
        self._streams: list = []  # CUDA: the default stream and the one step() ran on, ordered after any wait
        _EVERY.add(self)

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, pending: dict[int, BucketGather], param_buffers: dict[int, torch.Tensor],
              params: dict[int, list[torch.nn.Parameter]], guard: bool) -> None:
        """Take over ``pending`` (bucket index -> its gather into ``param_buffers[index]``, whose members are
        ``params[index]``): with ``guard``, leave them in flight behind the guards; without, wait for them now."""
        self.finish()
        self._pending, self._streams = dict(pending), []
        if not guard:
            self.finish()
            return
        self._device = next(iter(param_buffers.values())).device if param_buffers else None
        if self._device is not None and self._device.type == "cuda":
            self._streams = list({torch.cuda.default_stream(self._device), torch.cuda.current_stream(self._device)})
        self._bucket_of_storage = {buffer.untyped_storage().data_ptr(): index
                                   for index, buffer in param_buffers.items()}
        self._bucket_of_param = {id(p): index for index, members in params.items() for p in members}
        self._guard, self._thread = _Guard(self), threading.get_ident()
        _push_at_bottom(self._guard)
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def finish(self, buckets: Optional[Iterable[int]] = None) -> None:
        chosen = sorted(self._pending if buckets is None else set(buckets) & self._pending.keys())
        # a landing is zeroimpl's own work on its own buffers (8-bit decoding: thousands of operations per bucket)
        with guards_lifted() if chosen else contextlib.nullcontext():
            for index in chosen:
                pending = self._pending[index].pending
                pending.wait()  # (kept if it raised: every later read raises again)
                if pending.done:  # (not when this wait re-entered itself from its own landing: the outer one pops it)
                    self._pending.pop(index)
        if chosen and self._streams:
            # the wait was the current stream's; after a read on a side stream (an EMA's), the training loop's
            # streams, which will no longer wait for these buckets, must be ordered after it too
            current = torch.cuda.current_stream(self._device)
            for stream in self._streams:
                if stream != current:
                    stream.wait_stream(current)
        if not self._pending:
            self._remove_guards()

    def abandon(self) -> None:
        """Finish what is in flight for an optimizer that goes away; whatever that raises, no guard stays active."""
        try:
            self.finish()
        finally:
            self._pending.clear()
            self._remove_guards()

    def live_buffers(self) -> list[torch.Tensor]:
        """The scratch memory of the gathers in flight (:attr:`BucketGather.payloads`)."""
        return [gather.payloads for gather in self._pending.values() if gather.payloads is not None]

    def buckets_touched(self, args: tuple, kwargs: dict) -> set[int]:
        """The buckets in flight whose parameter buffer a call argument aliases (all, if a storage cannot be read)."""
        touched = set()
        for value in (*args, *kwargs.values()):
            for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(tensor, torch.Tensor):
                    try:
                        index = self._bucket_of_storage.get(tensor.untyped_storage().data_ptr())
                    except (RuntimeError, NotImplementedError):  # a functorch wrapper, a fake tensor, ...
                        return set(self._pending)
                    if index is not None:
                        touched.add(index)
        return touched

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        if type(module).__name__ in _WHOLE_MODULES:
            self.finish()
        elif self._pending:
            # this module's buckets, and every one that has arrived: once none is in flight the guards leave
            self.finish({self._bucket_of_param.get(id(p)) for p in module.parameters(recurse=False)} - {None}
                        | {index for index, gather in self._pending.items() if gather.pending.arrived()})
        else:
            self._remove_guards()  # only an inert mode was left: it can go now

    def _remove_guards(self) -> None:
        self._bucket_of_storage, self._bucket_of_param = {}, {}
        guard = self._guard
        if guard is None:
            return
        guard.active = False
        if guard.handling or threading.get_ident() != self._thread or _COLLECTOR[0] == self._thread:
            # from the mode's own handler (torch puts the mode back after it), another thread, or the garbage
            # collector (abandon, maybe inside a torch call that saw the mode on the stack): inert until the hook,
            # finish() or start() on its thread takes it off
            return
        _take_off(guard)
        shutdown.handed_to_gloo(guard)  # (a gloo work issued meanwhile may hold it)
        self._guard = None
        self._hook.remove()
        self._hook = None


def _take_inert_guards_off() -> None:
    """At exit, between the optimizers' finalizers and :mod:`zeroimpl.shutdown`'s wait (finalizers run newest first):
    the guards left inert on this thread's stack (their optimizer freed by the garbage collector, no forward since)
    leave it, handed to that wait."""
    for gathers in list(_EVERY):
        if gathers._guard is not None and not gathers._pending:
            gathers._remove_guards()


weakref.finalize(_EVERY, _take_inert_guards_off)


@contextlib.contextmanager
def guards_lifted():
    """Every guard off this thread's mode stack for the block: an inner step, maybe compiled with fullgraph=True."""
    thread = threading.get_ident()
    lifted = [] if _COLLECTOR[0] == thread else [  # (none from the garbage collector: see _remove_guards)
        gathers._guard for gathers in list(_EVERY) if gathers._guard is not None and gathers._thread == thread]
    lifted = [guard for guard in lifted if _take_off(guard)]
    try:
        yield
    finally:
        for guard in lifted:
            if guard.active:  # (one removed in the block, its gathers finished or abandoned, stays off)
                _push_at_bottom(guard)


class _Guard(TorchFunctionMode):
    """Waits for the buckets an operation touches before running it. The wait is a call torch.compile does not
    trace (:data:`COMPILED_READ`), wrapped only once torch._dynamo is imported: importing it costs seconds."""

    def __init__(self, gathers: InFlightGathers) -> None:
        super().__init__()
        self.gathers, self.active, self.handling = gathers, True, False
        self._wait = (torch.compiler.disable(self._wait_for_touched, reason=COMPILED_READ)
                      if "torch._dynamo" in sys.modules else self._wait_for_touched)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch took the mode off the stack until this returns: a forward inside the call (a recompute in backward)
        # leaves it inert for the hook (_remove_guards), which would otherwise drop it from the books, not the stack
        outer, self.handling = self.handling, True
        try:
            if self.active and func not in _METADATA_METHODS and not _reads_no_values(func):
                self._wait(args, kwargs)
            return func(*args, **kwargs)
        finally:
            self.handling = outer

    def _wait_for_touched(self, args: tuple, kwargs: dict) -> None:
        touched = self.gathers.buckets_touched(args, kwargs)
        if touched:
            self.gathers.finish(touched)


def _reads_no_values(func) -> bool:
    """An attribute read, or setting / deleting ``.grad``."""
    name = getattr(func, "__name__", "")
    return name == "__get__" or (name in ("__set__", "__delete__")
                                 and getattr(getattr(func, "__self__", None), "__name__", None) == "grad")


def _push_at_bottom(mode: TorchFunctionMode) -> None:
    """Push ``mode`` under all others but a ``DeviceContext`` (torch needs it at the bottom); it leaves by identity."""
    from torch.utils._device import DeviceContext

    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    keep_below = 1 if stack and isinstance(stack[0], DeviceContext) else 0
    for other in stack[:keep_below] + [mode] + stack[keep_below:]:
        torch._C._push_on_torch_function_stack(other)


def _take_off(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's mode stack, the others staying in order: whether it was there."""
    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    for other in stack:
        if other is not mode:
            torch._C._push_on_torch_function_stack(other)
    return any(other is mode for other in stack)
