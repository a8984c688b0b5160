"""Parameter all-gathers left in flight after ``step()`` (``overlap_param_gather``), and the guard that keeps
them out of sight: no torch operation reads or writes a parameter while its bucket is still being gathered.

While any gather is in flight, a :class:`torch.overrides.TorchFunctionMode` sits on the mode stack of the
thread that called ``step()``. A torch function or tensor method whose tensor arguments (top level, inside a
list or tuple, or keyword values) alias the parameter buffer of a bucket in flight first waits for that
bucket. So the forward waits for bucket i at the first operation that uses one of its parameters (the
overlap), and every other access sees this step's values with no call from the user: an evaluation,
``model.state_dict()``, ``torch.save``, ``p.clone()``, ``p.tolist()``, an EMA update, a write such as
``p.data.clamp_()``. Attribute access (``p.shape``, ``p.grad = None``, ``p.data``) and metadata methods
(``p.numel()``, ``p.data_ptr()``) do not wait: they read no values, and any later operation on what they
return (``p.data`` is an alias) waits then.

Not covered: other threads, and memory reached around torch (a NumPy array or a raw pointer taken before
``step()``). :meth:`InFlightGathers.finish` is the explicit wait for those.

The mode is popped once nothing is in flight if it is on top of the stack. When the last wait happens inside
its own handler (torch holds the mode off the stack while the handler runs) or under a mode the user entered
since, it stays, inert, and is popped at the next :meth:`InFlightGathers.finish` or :meth:`start`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from .comm import Pending

_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})  # of attributes (p.grad = None): no wait
# tensor methods that read only metadata: no wait for them
_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.storage_offset, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device, torch.Tensor.__hash__,
    torch.Tensor.data_ptr,
})


class InFlightGathers:
    """The all-gathers of one optimizer still in flight, by bucket index, and the guard that waits for them.

    Invariant: ``len(self)`` buckets are in flight; while any is; then the guard is on the mode stack of
    the thread that called :meth:`start` (unless that thread has since popped it itself)."""

    def __init__(self) -> None:
        self._pending: dict[int, Pending] = {}
        self._bucket_of_storage: dict[int, int] = {}  # data_ptr of a parameter buffer's storage -> bucket index
        self._guard: Optional[_Guard] = None

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, pending: dict[int, Pending], param_buffers: dict[int, torch.Tensor], guard: bool) -> None:
        """Take over ``pending`` (bucket index -> its gather into ``param_buffers[bucket index]``); with
        ``guard``, push the guard so that they may stay in flight; without, wait for them now."""
        self.finish()
        self._pending = dict(pending)
        if _get_current_function_mode() is not None:  # a mode of the user's (or torch.compile's) is active:
            guard = False  # ours would sit above it and could not be popped in order
        if not guard:
            self.finish()
            return
        self._bucket_of_storage = {buffer.untyped_storage().data_ptr(): index
                                   for index, buffer in param_buffers.items()}
        self._guard = _Guard(self)
        self._guard.__enter__()

    def finish(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the gathers of ``buckets`` (default: all), in bucket order."""
        chosen = sorted(self._pending if buckets is None else set(buckets) & self._pending.keys())
        for index in chosen:
            self._pending.pop(index).wait()
        if not self._pending:
            self._bucket_of_storage = {}
            self._drop_guard()

    def buckets_touched(self, args: tuple, kwargs: dict) -> set[int]:
        """The buckets in flight whose parameter buffer one of these call arguments aliases."""
        touched = set()
        for value in (*args, *kwargs.values()):
            for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(tensor, torch.Tensor):
                    try:
                        index = self._bucket_of_storage.get(tensor.untyped_storage().data_ptr())
                    except (RuntimeError, NotImplementedError):  # no storage: fake, sparse, a subclass's wrapper
                        continue
                    if index is not None:
                        touched.add(index)
        return touched

    def _drop_guard(self) -> None:
        guard = self._guard
        if guard is None:
            return
        guard.active = False
        if not guard.handling and _get_current_function_mode() is guard:
            guard.__exit__(None, None, None)
            self._guard = None


class _Guard(TorchFunctionMode):
    """Waits for the buckets an operation touches before running it (see the module docstring)."""

    def __init__(self, gathers: InFlightGathers) -> None:
        super().__init__()
        self.gathers, self.active, self.handling = gathers, True, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func not in _METADATA_METHODS and getattr(func, "__name__", "") not in _ACCESSORS:
            touched = self.gathers.buckets_touched(args, kwargs)
            if touched:
                self.handling = True
                try:
                    self.gathers.finish(touched)
                finally:
                    self.handling = False
        return func(*args, **kwargs)
