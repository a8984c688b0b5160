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
    """Bytes by kind, counting each storage once (for the first kind, in MODEL_STATE_KINDS order, that
    holds it) and whole: a parameter that is a view of a flat buffer counts as the buffer."""
    seen: set = set()
    counts = {}
    for kind in MODEL_STATE_KINDS:
        total = 0
        for tensor in tensors_by_kind.get(kind, []):
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        counts[kind] = total
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
