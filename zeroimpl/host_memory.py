"""Host memory next to a GPU: copies to the device that do not block the host.

On CUDA, a copy from pageable host memory (``torch.tensor(values, device="cuda")``, ``cpu_tensor.to("cuda")``)
makes the host wait for the device; staged through page-locked memory and issued with ``non_blocking=True``
it is queued on the current stream like a kernel. The page-locked block comes from torch's caching host
allocator, which does not reuse it before the copy has run. Off CUDA these are plain copies.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (any device) on ``device``, without a host sync when it goes from the CPU to a GPU."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync (see :func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
