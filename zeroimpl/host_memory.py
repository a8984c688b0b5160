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
    block up to a power of two: per-bucket buffers could cost up to twice their bytes. Here one ordinary
    allocation is registered with ``cudaHostRegister`` (portable: every device's copies see it as
    page-locked), so the page-locked bytes are :attr:`nbytes`: the sum of the slices, rounded up to whole
    pages when pinned (the registered range starts on a page and shares none with any other allocation, which
    ``cudaHostRegister`` could refuse as registered already). Slices are laid out widest dtype first, so that
    each starts aligned to its element size with no gap between them. Unregistered (after the device has
    finished every queued copy) when the arena is garbage collected.
    """

    def __init__(self, sizes: list[tuple[int, torch.dtype]], pin_device: Optional[torch.device]):
        offsets, total = {}, 0
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i][1].itemsize):
            offsets[index] = total
            total += sizes[index][0] * sizes[index][1].itemsize
        self.pinned = pin_device is not None and total > 0
        self._block = page_aligned_bytes(total, mmap.PAGESIZE if self.pinned else 1)
        if self.pinned:
            try:
                _register(self._block, pin_device)
                weakref.finalize(self, _unregister, self._block, pin_device)
            except (RuntimeError, AttributeError) as error:  # no cudaHostRegister here (a sandbox, another build)
                _clear_cuda_error(pin_device)
                warnings.warn(f"zeroimpl: cudaHostRegister failed ({error}); the offloaded host buffers are "
                              "page-locked by torch's caching host allocator instead, which may round them up to "
                              "a power of two", RuntimeWarning, stacklevel=3)
                self._block = self._block.pin_memory()
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


def page_aligned_bytes(nbytes: int, page: int) -> torch.Tensor:
    """Zeroed host bytes, ``nbytes`` rounded up to whole ``page`` s, starting on a page: a view into a larger
    allocation of its own, so that no other allocation shares its pages."""
    length = -(-nbytes // page) * page
    allocation = torch.zeros(length + page - 1, dtype=torch.uint8)
    skip = -allocation.data_ptr() % page
    return allocation[skip:skip + length]


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
