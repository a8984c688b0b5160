"""Host memory next to a GPU: copies to the device that do not block the host, and page-locked buffers
that cost exactly their bytes.

On CUDA, a copy from pageable host memory (``torch.tensor(values, device="cuda")``, ``cpu_tensor.to("cuda")``)
makes the host wait for the device; staged through page-locked memory and issued with ``non_blocking=True``
it is queued on the current stream like a kernel. The page-locked block comes from torch's caching host
allocator, which does not reuse it before the copy has run. Off CUDA these are plain copies.
"""

from __future__ import annotations

import warnings
import weakref

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
    """Host tensors of one dtype carved out of one allocation, page-locked as one exact range when ``pin``.

    ``pin_memory=True`` takes page-locked memory from torch's caching host allocator, which rounds every
    block up to a power of two: per-bucket buffers could cost up to twice their bytes. Here an ordinary
    allocation is registered with ``cudaHostRegister`` instead, so the page-locked bytes are exactly
    :attr:`nbytes`, the sum of the slices (no gaps: slices follow each other in ``numels`` order).
    Unregistered (after the device has finished every queued copy) when the arena is garbage collected.
    """

    def __init__(self, numels: list[int], dtype: torch.dtype, pin: bool):
        self._block = torch.zeros(sum(numels), dtype=dtype)
        self.pinned = pin and self._block.numel() > 0
        if self.pinned:
            try:
                _register(self._block)
                weakref.finalize(self, _unregister, self._block)
            except (RuntimeError, AttributeError) as error:  # no cudaHostRegister here (a sandbox, another build)
                warnings.warn(f"zeroimpl: cudaHostRegister failed ({error}); the offloaded host buffers are "
                              "page-locked by torch's caching host allocator instead, which may round them up to "
                              "a power of two", RuntimeWarning, stacklevel=3)
                self._block = self._block.pin_memory()
        self.slices: list[torch.Tensor] = list(self._block.split(numels))

    @property
    def nbytes(self) -> int:
        return self._block.numel() * self._block.element_size()


def host_buffers(numels: list[int], dtypes: list[torch.dtype], pin: bool) -> tuple[list[torch.Tensor], list[HostArena]]:
    """Zeroed 1-D host tensors of these sizes and dtypes, in order, from one :class:`HostArena` per dtype."""
    arenas, slices = [], [None] * len(numels)
    for dtype in dict.fromkeys(dtypes):
        chosen = [i for i, d in enumerate(dtypes) if d == dtype]
        arena = HostArena([numels[i] for i in chosen], dtype, pin)
        arenas.append(arena)
        for i, tensor in zip(chosen, arena.slices):
            slices[i] = tensor
    return slices, arenas


def _register(block: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
        block.data_ptr(), block.numel() * block.element_size(), 0))


def _unregister(block: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy may still read or write the range
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(block.data_ptr()))
