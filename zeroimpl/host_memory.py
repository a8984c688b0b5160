"""Host memory next to a GPU: copies to the device that do not make the host wait (:func:`to_device`), and
page-locked buffers that cost their bytes up to a page (:class:`HostArena`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
import weakref
from typing import Optional

import torch

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (any device) on ``device``, without a host sync from the CPU to a GPU: staged through torch's caching
    pinned allocator (which reuses no block before its copy has run), queued on the current stream."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostArena:
    """Host tensors of several dtypes carved from one whole-page mapping (:func:`whole_pages`) that ``cudaHostRegister``
    page-locks (portable: for every device), so the page-locked bytes are :attr:`nbytes`, the slices' rounded up to
    whole pages (``pin_memory=True`` rounds each to a power of two). Slices, widest dtype first, aligned, no gaps, are
    each a storage over the mapping that keeps it alive (``torch.save`` writes only its bytes; ``is_pinned()`` asks
    about its first byte). When :attr:`pinned`, every non-empty slice is ``is_pinned()``: if registration fails or torch
    does not count it, each is copied into torch's pinned allocator, with a warning (:attr:`registered` False).
    Unregistered on collection, after the device's queued copies; its owner keeps it while it copies."""

    def __init__(self, sizes: list[tuple[int, torch.dtype]], pin_device: Optional[torch.device]):
        offsets, total = {}, 0
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i][1].itemsize):
            offsets[index] = total
            total += sizes[index][0] * sizes[index][1].itemsize
        self.pinned = pin_device is not None and total > 0
        pages = whole_pages(total, inherited=not self.pinned)
        self.start: Optional[int] = torch.frombuffer(pages, dtype=torch.uint8).data_ptr()
        """The mapping's first byte (None after the fallback below: the slices are separate allocations)."""
        self.nbytes = len(pages)
        """The bytes the arena holds: the mapping's (after the fallback, the slices' before torch rounds them)."""
        self.slices: list[torch.Tensor] = [torch.frombuffer(pages, dtype=dtype, count=numel, offset=offsets[i])
                                           if numel else torch.zeros(0, dtype=dtype)
                                           for i, (numel, dtype) in enumerate(sizes)]
        self.registered = self.pinned and _registered(self, pages, pin_device)
        if self.pinned and not self.registered:  # the mapping goes with the slices that held it
            self.slices = [piece.pin_memory() for piece in self.slices]
            self.start, self.nbytes = None, total


def whole_pages(nbytes: int, inherited: bool = True) -> mmap.mmap:
    """Zeroed host bytes, ``nbytes`` rounded up to whole pages (at least one), from an anonymous private mapping: it
    starts on a page and shares no page with another allocation (``cudaHostRegister`` refuses a page registered
    already). Not ``inherited``: a forked child (a DataLoader worker) gets none of it, so that no write of this
    process copies a page away from under the device's copies (copy-on-write); skipped where the kernel refuses."""
    length = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # (Windows: always private)
    pages = mmap.mmap(-1, length, **private)
    if not inherited and hasattr(mmap, "MADV_DONTFORK"):
        with contextlib.suppress(OSError):  # a sandbox's kernel: the advice is a safeguard, not a need
            pages.madvise(mmap.MADV_DONTFORK)
    return pages


def _registered(arena: HostArena, pages: mmap.mmap, device: torch.device) -> bool:
    """Whether ``arena``'s ``pages`` are now registered (until ``arena`` is collected) and torch counts its slices
    as pinned; if not, the registration is undone, a failure's CUDA error consumed, and a warning says why."""
    try:
        with torch.cuda.device(device):
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(arena.start, arena.nbytes, _HOST_REGISTER_PORTABLE))
    except (RuntimeError, AttributeError) as error:  # no cudaHostRegister here (a sandbox, another build)
        # consume the error the failed call left as the thread's last error, which the next checked kernel launch
        # would otherwise raise, far from its cause: a one-element launch here raises it, as expected
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device=device)
            torch.cuda.synchronize(device)
        reason = f"cudaHostRegister failed ({error})"
    else:
        unregister = weakref.finalize(arena, _unregister, pages, arena.start, device, os.getpid())
        if all(piece.is_pinned() for piece in arena.slices if piece.numel()):
            return True
        unregister()
        reason = "this torch does not count memory registered with cudaHostRegister as pinned"
    warnings.warn(f"zeroimpl: {reason}; the offloaded host buffers are page-locked by torch's caching host "
                  "allocator instead, which rounds each up to a power of two",
                  RuntimeWarning, stacklevel=6)  # (the user's ShardedOptimizer(...) line)
    return False


def _unregister(pages: mmap.mmap, address: int, device: torch.device, registrant: int) -> None:
    """Holds ``pages`` (the range stays mapped while registered); a forked child (no CUDA context) does nothing."""
    if os.getpid() != registrant:
        return
    torch.cuda.synchronize(device)  # no copy may still read or write the range
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))
