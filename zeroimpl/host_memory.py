"""Host memory next to a GPU: copies to the device that do not block the host, and page-locked buffers
that cost exactly their bytes.

On CUDA, a copy from pageable host memory (``torch.tensor(values, device="cuda")``, ``cpu_tensor.to("cuda")``)
makes the host wait for the device; staged through page-locked memory and issued with ``non_blocking=True``
it is queued on the current stream like a kernel. The page-locked block comes from torch's caching host
allocator, which does not reuse it before the copy has run. Off CUDA these are plain copies.
"""

from __future__ import annotations

import mmap
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
    """Host tensors of several dtypes carved out of one allocation, page-locked as one exact range on a GPU.

    ``pin_memory=True`` takes page-locked memory from torch's caching host allocator, which rounds every
    block up to a power of two: per-bucket buffers could cost up to twice their bytes. Here one allocation of
    whole pages of its own (:func:`whole_pages`) is registered with ``cudaHostRegister`` (portable: every
    device's copies see it as page-locked), so the page-locked bytes are :attr:`nbytes`: the sum of the
    slices rounded up to whole pages. Invariant when :attr:`pinned`: every slice is ``is_pinned()`` (torch
    asks about a tensor's storage, which starts on the registered range's first byte); where the
    registration fails or torch does not see it, the arena falls back to torch's allocator and warns. Slices
    are laid out widest dtype first, so that each starts aligned to its element size with no gap between
    them. Unregistered (after the device has finished every queued copy) when the arena is garbage
    collected: the owner keeps the arena as long as it copies through the slices.
    """

    def __init__(self, sizes: list[tuple[int, torch.dtype]], pin_device: Optional[torch.device]):
        offsets, total = {}, 0
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i][1].itemsize):
            offsets[index] = total
            total += sizes[index][0] * sizes[index][1].itemsize
        self.pinned = pin_device is not None and total > 0
        self._block = whole_pages(total) if self.pinned else torch.zeros(total, dtype=torch.uint8)
        if self.pinned:
            self._block = _page_locked(self._block, pin_device, owner=self)
        self.slices: list[torch.Tensor] = [
            self._block[offsets[i]:offsets[i] + numel * dtype.itemsize].view(dtype)
            for i, (numel, dtype) in enumerate(sizes)]

    @property
    def nbytes(self) -> int:
        return self._block.numel()

    @property
    def start(self) -> int:
        """The address of the first byte."""
        return self._block.data_ptr()


def whole_pages(nbytes: int) -> torch.Tensor:
    """Zeroed host bytes, ``nbytes`` rounded up to whole pages, from an anonymous private mapping: the
    tensor's storage starts on a page (where ``Tensor.is_pinned`` looks) and no other allocation shares its
    pages (``cudaHostRegister`` refuses a page registered already). The tensor keeps the mapping alive."""
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if length == 0:
        return torch.zeros(0, dtype=torch.uint8)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # (Windows: always private)
    return torch.frombuffer(mmap.mmap(-1, length, **private), dtype=torch.uint8)


def _page_locked(block: torch.Tensor, device: torch.device, owner: object) -> torch.Tensor:
    """``block`` registered with ``cudaHostRegister`` (unregistered when ``owner`` is collected), or, where
    that fails or torch does not count the registration as pinned, a copy from torch's pinned allocator,
    with a warning. Either way ``is_pinned()`` holds for the result and every view of it."""
    try:
        _register(block, device)
    except (RuntimeError, AttributeError) as error:  # no cudaHostRegister here (a sandbox, another build)
        _clear_cuda_error(device)
        reason = f"cudaHostRegister failed ({error})"
    else:
        if block.is_pinned():
            weakref.finalize(owner, _unregister, block, device)
            return block
        _unregister(block, device)
        reason = "this torch does not count memory registered with cudaHostRegister as pinned"
    warnings.warn(f"zeroimpl: {reason}; the offloaded host buffers are page-locked by torch's caching host "
                  "allocator instead, which may round them up to a power of two", RuntimeWarning, stacklevel=4)
    return block.pin_memory()


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


def _register(block: torch.Tensor, device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(),
                                                                    _HOST_REGISTER_PORTABLE))


def _unregister(block: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy may still read or write the range
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(block.data_ptr()))
