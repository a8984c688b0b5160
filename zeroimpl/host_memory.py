"""Host memory next to a GPU: copies to the device that do not block the host, and page-locked buffers
that cost their bytes up to a page.

On CUDA, a copy from pageable host memory (``torch.tensor(values, device="cuda")``, ``cpu_tensor.to("cuda")``)
makes the host wait for the device; staged through page-locked memory and issued with ``non_blocking=True``
it is queued on the current stream like a kernel. The page-locked block comes from torch's caching host
allocator, which does not reuse it before the copy has run. Off CUDA these are plain copies.
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref
from typing import Optional

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (any device) on ``device``, without a host sync when it goes from the CPU to a GPU."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync (see :func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostArena:
    """Host tensors of several dtypes carved out of one allocation of whole pages, page-locked as one range on
    a GPU.

    ``pin_memory=True`` takes page-locked memory from torch's caching host allocator, which rounds every
    block up to a power of two: per-bucket buffers could cost up to twice their bytes. Here one anonymous
    private mapping (:func:`whole_pages`: zeroed, of its own pages) holds every slice, and on a GPU it is
    registered with ``cudaHostRegister`` (portable: every device's copies see it as page-locked), so the
    page-locked bytes are :attr:`nbytes`: the slices' bytes rounded up to whole pages. Slices are laid out
    widest dtype first, so that each starts aligned to its element size with no gap between them.

    Invariants: each slice is a storage of its own over the mapping (``torch.save`` of one writes its bytes,
    not the arena's; ``is_pinned()`` asks about the slice's own first byte), and each keeps the mapping
    alive. When :attr:`pinned`, every non-empty slice is ``is_pinned()``: where the registration fails, or torch does
    not count it, each slice is copied into torch's pinned allocator instead, with a warning
    (:attr:`registered` is False then). The range is unregistered, after the device has finished every
    queued copy, when the arena is garbage collected: its owner keeps it as long as it copies through the
    slices.
    """

    def __init__(self, sizes: list[tuple[int, torch.dtype]], pin_device: Optional[torch.device]):
        offsets, total = {}, 0
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i][1].itemsize):
            offsets[index] = total
            total += sizes[index][0] * sizes[index][1].itemsize
        self.pinned = pin_device is not None and total > 0
        pages = whole_pages(total, inherited=not self.pinned)
        self.start: Optional[int] = _address(pages)
        """The mapping's first byte (None after the fallback below: the slices are separate allocations)."""
        self.nbytes = len(pages)
        """The bytes the arena holds: the mapping's (after the fallback, the slices' before torch rounds them)."""
        self.slices: list[torch.Tensor] = [_view(pages, offsets[i], numel, dtype)
                                           for i, (numel, dtype) in enumerate(sizes)]
        self.registered = self.pinned and _registered(self, pages, pin_device)
        if self.pinned and not self.registered:  # the mapping goes with the slices that held it
            self.slices = [piece.pin_memory() for piece in self.slices]
            self.start, self.nbytes = None, total


def whole_pages(nbytes: int, inherited: bool = True) -> mmap.mmap:
    """Zeroed host bytes, ``nbytes`` rounded up to whole pages (at least one), from an anonymous private
    mapping: it starts on a page and no other allocation shares its pages (``cudaHostRegister`` refuses a
    page registered already); a forked child writes into its own copy. Not ``inherited``: a forked child
    (a DataLoader worker) has none of it (a child that touches it faults), so that no write of this process
    copies a page away from under the device's copies (copy-on-write, on kernels or drivers that pin
    without copying pinned pages at fork); where the kernel refuses the advice, it is left out."""
    length = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # (Windows: always private)
    pages = mmap.mmap(-1, length, **private)
    if not inherited and hasattr(mmap, "MADV_DONTFORK"):
        try:
            pages.madvise(mmap.MADV_DONTFORK)
        except OSError:  # a sandbox's kernel: the advice is a safeguard, not a need
            pass
    return pages


def _address(pages: mmap.mmap) -> int:
    return torch.frombuffer(pages, dtype=torch.uint8).data_ptr()


def _view(pages: mmap.mmap, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of ``pages``, as a storage of their own that keeps
    ``pages`` alive."""
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(pages, dtype=dtype, count=numel, offset=offset)


def _registered(arena: HostArena, pages: mmap.mmap, device: torch.device) -> bool:
    """Whether ``arena``'s ``pages`` are now registered with ``cudaHostRegister`` and torch counts its slices as
    pinned (then unregistered when ``arena`` is collected); if not, the registration is undone, the CUDA
    error a failure leaves is consumed, and a warning says why."""
    try:
        _register(arena.start, arena.nbytes, device)
    except (RuntimeError, AttributeError) as error:  # no cudaHostRegister here (a sandbox, another build)
        _clear_cuda_error(device)
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


def _clear_cuda_error(device: torch.device) -> None:
    """Consume the error a failed CUDA runtime call left as the thread's last error: otherwise the next checked
    kernel launch (which reads and resets it) would raise it, far from its cause. A one-element launch here
    reads it; what it raises is that stale error, expected."""
    try:
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _register(address: int, nbytes: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))


def _unregister(pages: mmap.mmap, address: int, device: torch.device, registrant: int) -> None:
    """(``pages``: held until here, so that the range stays mapped while registered. In a forked child, which
    has no CUDA context and none of these pages, at its exit: nothing to do.)"""
    if os.getpid() != registrant:
        return
    torch.cuda.synchronize(device)  # no copy may still read or write the range
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))
