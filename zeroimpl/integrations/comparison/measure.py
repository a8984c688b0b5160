"""Memory measurements inside one rank: model-state bytes by kind, and peak memory past start-up.

Peak memory: CUDA's max allocated bytes on a GPU; on the CPU the peak resident set (``VmHWM``) after
resetting it (``/proc/self/clear_refs``), minus the resident set at the reset. Both start counting after
imports and process-group set-up, so that only the model and its training are measured.
"""

from __future__ import annotations

import re

import torch

from ..adapters.base import MODEL_STATE_KINDS


def model_state_bytes(tensors_by_kind: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes by kind, each byte of each storage counted once: for the first kind (in MODEL_STATE_KINDS order)
    of a tensor that spans it, and the bytes that no tensor spans (a flat buffer's padding) for the first kind
    that holds a tensor in that storage. So a parameter that is a view of a flat buffer counts as the
    buffer, and one storage shared by several kinds is split between them. (zeroimpl's host arena gives
    each buffer a storage of its own: the tail of its last page, under a page, is counted by no kind.)"""
    spans: dict = {}  # (device, storage address) -> (storage bytes, [(kind order, start, end)])
    for order, kind in enumerate(MODEL_STATE_KINDS):
        for tensor in tensors_by_kind.get(kind, []):
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or tensor.numel() == 0:
                continue
            extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size)
            start = tensor.storage_offset() * tensor.element_size()
            entry = spans.setdefault((tensor.device, storage.data_ptr()), (storage.nbytes(), []))
            entry[1].append((order, start, min(start + extent * tensor.element_size(), storage.nbytes())))
    counts = dict.fromkeys(MODEL_STATE_KINDS, 0)
    for nbytes, covering in spans.values():
        first = min(order for order, _, _ in covering)
        cuts = sorted({0, nbytes, *(start for _, start, _ in covering), *(end for _, _, end in covering)})
        for low, high in zip(cuts, cuts[1:]):
            owners = [order for order, start, end in covering if start <= low and high <= end]
            counts[MODEL_STATE_KINDS[min(owners, default=first)]] += high - low
    counts["total"] = sum(counts.values())
    return counts


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))


class PeakMemory:
    """Peak memory of this process from :meth:`start` on, in bytes, on ``device``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset the peak resident set to the current one
            self.baseline = _resident_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _resident_kib("VmHWM") * 1024 - self.baseline
