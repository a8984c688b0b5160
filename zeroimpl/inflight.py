"""The parameter all-gathers left in flight after ``step()`` (``overlap_param_gather``), and the guard that keeps
its promise: every read of a parameter after ``step()`` sees the new values or waits for them (or raises,
where its all-gather failed: :class:`zeroimpl.pending.Pending`). Results are bitwise those of
``overlap_param_gather=False``.

Reads that are seen, and how:

* Through torch, on the thread that called ``step()``: a :class:`~torch.overrides.TorchFunctionMode` at the
  bottom of its mode stack waits for the buckets whose parameter buffer a tensor argument aliases (top level,
  in a list or tuple, or a keyword value; an argument whose storage cannot be read -- a ``torch.func``
  wrapper, a fake tensor -- waits for all). So the forward waits for bucket i at its first operation on one
  of its parameters (the overlap), and an evaluation, ``state_dict()``, ``torch.save``, ``p.clone()``,
  ``p.tolist()``, an EMA update or a write (``p.data.clamp_()``) see the new values. Reads of metadata alone
  (``p.shape``, ``p.data``, ``p.numel()``, ``p.data_ptr()``, setting ``p.grad``) do not wait.
* A module's forward, on any thread: a global forward pre-hook waits for the module's own parameters'
  buckets, and for every bucket before a TorchScript or ``torch.compile`` module (whose code, like C++
  extensions' kernels and custom ``autograd.Function`` s, runs below the mode). Under ``torch.compile`` the
  wait is a graph break; with ``fullgraph=True`` an error naming the fixes (:data:`COMPILED_READ`).
* On CUDA a wait is a stream's: the stream of the read waits, and then the default stream and the one
  ``step()`` ran on wait for it.

Reads that are not seen -- another thread's outside a module's forward, a third CUDA stream, kernels reached
around torch (a NumPy array or raw pointer taken before ``step()``, apex's multi-tensor kernels, a
``@torch.jit.script`` function, ``torch.utils.dlpack``, code under ``torch._C.DisableTorchFunction()``): call
``optimizer.finish_param_gathers()`` first (:meth:`InFlightGathers.finish`), or build the optimizer with
``overlap_param_gather=False``.

One rule for new code. zeroimpl's own work on its own tensors (an inner optimizer's step, a gather's landing) runs
under :func:`guards_lifted`; anything else that hands parameters to code the guards cannot see (a framework's
checkpoint or export, another thread, raw storage) calls ``ShardedOptimizer.finish_param_gathers()`` first, as the
integrations do through their one seam (``ShardedStrategy.finish_param_gathers``, ``ZeroTrainer.save_model``).

Why this and not Megatron's module pre-hooks alone: with hooks alone, reads outside a module's forward (an EMA
update, ``p.data.clamp_()``, a functional evaluation) would see the previous step's values, or be overwritten when
the gather lands, silently; the mode is what keeps those reads right, and it costs a Python call per torch
operation only while a gather is in flight (``benchmarks/results/guard_cost*.md``: noise where the guard leaves at
the first module forward, as on NCCL; +3.7 to +4.9 µs per call on CPU where it stays for the forward). Why torch's
private stack calls: a mode pushed with the public ``with``/``__enter__`` sits on top, and a user's ``with mode:``
block that spans ``step()`` would pop the guard, not its own mode, when it exits.

The machinery, kept as small as the promise allows: the mode and the hook exist only while a gather is in
flight (before each forward the gathers that have arrived, where the backend tells, are finished without a
wait, so the cost per operation stops as soon as the last one lands); the inner optimizers step with the guards
lifted (:func:`guards_lifted`: an inner step may be compiled code). A wait from inside the mode's own handler
cannot take it off the stack (torch holds it off and puts it back): it stays inert until the hook, ``finish``
or ``start`` removes it. A guard taken off the stack goes to :mod:`zeroimpl.shutdown` (a gloo work issued
meanwhile may hold it). What is load-bearing, and the tests that guard it: the edits of torch's private mode
stack (:func:`_push_at_bottom`, :func:`_remove_from_stack`: the guard outlives a user's ``with mode:`` and stays
above ``torch.set_default_device``'s ``DeviceContext``) and the hook (TorchScript, compile, custom kernels,
threads): ``tests/test_inflight_overlap.py::test_reads_below_torch_functions_and_the_mode_stack``; every argument seen
(:meth:`InFlightGathers.buckets_touched`): ``test_every_read_after_step_sees_the_new_parameters``,
``test_a_users_own_read_or_write_after_step_sees_the_new_parameters`` and test_optimizer_mutation_guards.py's keyword
case; bitwise results: ``test_overlapped_gathers_give_bitwise_the_same_training``; exit safety:
``tests/test_shutdown.py``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Iterable, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import shutdown
from .pending import Pending

# tensor methods that read only metadata: no wait for them
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


class BucketGather(NamedTuple):
    """One bucket's all-gather in flight: its wait, and the scratch memory it lands from (every rank's 8-bit
    payload, ``(world_size * payload_bytes,)`` uint8, for a quantized all-gather; else None)."""

    pending: Pending
    payloads: Optional[torch.Tensor] = None


class InFlightGathers:
    """The all-gathers of one optimizer still in flight, by bucket index, and the guards that wait for them.

    Invariant: ``len(self)`` buckets are in flight; while any is, the mode is on the thread's mode stack and
    the forward pre-hook is registered."""

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
        """Take over ``pending`` (bucket index -> its gather into ``param_buffers[bucket index]``, whose
        members are ``params[bucket index]``); with ``guard``, install the guards so that they may stay in
        flight; without, wait for them now."""
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
        """Wait for the gathers of ``buckets`` (default: all), in bucket order."""
        chosen = sorted(self._pending if buckets is None else set(buckets) & self._pending.keys())
        # a landing is zeroimpl's own work on its own buffers (an 8-bit gather's decoding: thousands of operations
        # per bucket), which the guards need not see
        with guards_lifted() if chosen else contextlib.nullcontext():
            for index in chosen:
                pending = self._pending[index].pending
                pending.wait()  # (kept if it raised: every later read raises again)
                if pending.done:  # (not when this wait re-entered itself from its own landing: the outer one pops it)
                    self._pending.pop(index)
        if chosen and self._streams:
            # on CUDA the wait is the current stream's; a read on a side stream (an EMA on its own stream) must
            # order the streams of the training loop too, which run the next forward and no longer wait for
            # these buckets
            current = torch.cuda.current_stream(self._device)
            for stream in self._streams:
                if stream != current:
                    stream.wait_stream(current)
        if not self._pending:
            self._remove_guards()

    def abandon(self) -> None:
        """Finish what is in flight for an optimizer that goes away; whatever that raises, no guard stays."""
        try:
            self.finish()
        finally:
            self._pending.clear()
            self._remove_guards()

    def live_buffers(self) -> list[torch.Tensor]:
        """The scratch memory of the gathers in flight (:attr:`BucketGather.payloads`)."""
        return [gather.payloads for gather in self._pending.values() if gather.payloads is not None]

    def buckets_touched(self, args: tuple, kwargs: dict) -> set[int]:
        """The buckets in flight whose parameter buffer one of these call arguments aliases (all of them for
        an argument whose storage cannot be read)."""
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
            # the buckets this module reads, and every one that has arrived meanwhile: once none is left in
            # flight the guards leave, and the rest of the forward runs at full speed
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
        if guard.handling or threading.get_ident() != self._thread:
            return  # the hook (still registered), finish() or start() on its thread takes it off the stack later
        _remove_from_stack(guard)
        self._guard = None
        self._hook.remove()
        self._hook = None


@contextlib.contextmanager
def guards_lifted():
    """Every optimizer's guard off this thread's mode stack while the block runs, and back under the other modes
    after it: for an inner optimizer's step, which reads its own optimizer's tensors alone and may be code that
    torch.compile traces with fullgraph=True (torchao's optimizers), which could not trace a guard."""
    thread = threading.get_ident()
    lifted = [gathers._guard for gathers in list(_EVERY) if gathers._guard is not None and gathers._thread == thread]
    lifted = [guard for guard in lifted if _take_off(guard)]
    try:
        yield
    finally:
        for guard in lifted:
            _push_at_bottom(guard)


class _Guard(TorchFunctionMode):
    """Waits for the buckets an operation touches before running it (see the module docstring). Under
    torch.compile the wait is a call the compiler does not trace: a graph break, and with ``fullgraph=True`` an
    error that names the fix (:data:`COMPILED_READ`; only once torch's compiler is imported, which costs seconds)."""

    def __init__(self, gathers: InFlightGathers) -> None:
        super().__init__()
        self.gathers, self.active, self.handling = gathers, True, False
        self._wait = self._wait_for_touched
        if "torch._dynamo" in sys.modules:
            self._wait = torch.compiler.disable(self._wait_for_touched, reason=COMPILED_READ)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func not in _METADATA_METHODS and not _reads_no_values(func):
            self._wait(args, kwargs)
        return func(*args, **kwargs)

    def _wait_for_touched(self, args: tuple, kwargs: dict) -> None:
        touched = self.gathers.buckets_touched(args, kwargs)
        if touched:
            self.handling = True
            try:
                self.gathers.finish(touched)
            finally:
                self.handling = False


def _reads_no_values(func) -> bool:
    """An attribute read, or setting / deleting ``.grad``."""
    name = getattr(func, "__name__", "")
    return name == "__get__" or (name in ("__set__", "__delete__")
                                 and getattr(getattr(func, "__self__", None), "__name__", None) == "grad")


# torch keeps a thread's TorchFunctionModes on a stack whose public API pushes and pops the top only; a user's
# `with mode:` pops the top on exit, so the guard, which outlives such blocks, goes to the bottom (above a
# DeviceContext, which torch keeps at the very bottom) and leaves by identity.
def _push_at_bottom(mode: TorchFunctionMode) -> None:
    """Push ``mode`` under every other mode but a ``torch.set_default_device`` / ``with torch.device`` one,
    which torch requires at the very bottom."""
    from torch.utils._device import DeviceContext

    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    keep_below = 1 if stack and isinstance(stack[0], DeviceContext) else 0
    for other in stack[:keep_below] + [mode] + stack[keep_below:]:
        torch._C._push_on_torch_function_stack(other)


def _remove_from_stack(mode: TorchFunctionMode) -> None:
    _take_off(mode)
    shutdown.handed_to_gloo(mode)


def _take_off(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's mode stack, the others staying in order: whether it was there."""
    above, found = [], False
    while torch._C._len_torch_function_stack() and not found:
        top = torch._C._pop_torch_function_stack()
        found = top is mode
        if not found:
            above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
    return found
