"""Count the collectives this process issues through ``torch.distributed``, with their sizes.

Used to check communication volume (tests, the Trainer example). It replaces the module attributes of
``torch.distributed`` while installed, so it sees every call made as ``dist.<name>(...)`` at call time --
zeroimpl's, accelerate's, DDP's Python-side calls -- but not collectives issued from C++ (DDP's bucket
all-reduces) or through names imported before installation. Restore with :meth:`uninstall`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor",
               "all_gather_into_tensor", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single",
               "reduce", "gather", "scatter", "all_reduce_coalesced", "all_gather_object", "barrier")
SIZE_ARGUMENT = {"reduce_scatter_single": 1, "reduce_scatter_tensor": 1}  # the input; otherwise the first tensor


class Call(NamedTuple):
    name: str
    numel: int  # elements of the tensor that measures the call's size (0 for calls without one)
    dtype: Optional[torch.dtype]


class CollectiveCounter:
    """``install()``, run, then ``take()`` the calls made since the last ``take()``."""

    def __init__(self):
        self.calls: list[Call] = []
        self._originals: dict[str, object] = {}

    def install(self) -> "CollectiveCounter":
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._counted(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls

    def _counted(self, name: str, original):
        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sized = tensors[SIZE_ARGUMENT.get(name, 0)] if len(tensors) > SIZE_ARGUMENT.get(name, 0) else None
            self.calls.append(Call(name, sized.numel() if sized is not None else 0,
                                   sized.dtype if sized is not None else None))
            return original(*args, **kwargs)

        return counted


def summarize(calls: list[Call]) -> dict[str, tuple[int, int, set]]:
    """name -> (number of calls, total elements, dtypes)."""
    summary: dict[str, tuple[int, int, set]] = {}
    for name, numel, dtype in calls:
        count, total, dtypes = summary.get(name, (0, 0, set()))
        summary[name] = (count + 1, total + numel, dtypes | {dtype})
    return summary
