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
               "reduce", "gather", "scatter", "all_reduce_coalesced", "all_gather_object", "barrier",
               "isend", "irecv")  # point-to-point: zeroimpl's pairwise reduce-scatter / all-gather on gloo


class Call(NamedTuple):
    name: str
    numel: int  # elements of the full tensor the collective reduces or gathers (0 for calls without one);
    #             isend / irecv: the elements sent / received
    dtype: Optional[torch.dtype]
    ranks: Optional[tuple[int, ...]] = None  # the global ranks of the call's group (None: not recorded)
    peer: Optional[int] = None  # isend / irecv: the global rank sent to / received from


def _full_size(args, kwargs) -> tuple[int, Optional[torch.dtype]]:
    """The call's full size: its largest tensor argument, or list of tensors summed, positional or keyword.

    That is the reduced tensor of an all-reduce / reduce / broadcast, the input of a reduce-scatter and the
    output of an all-gather, whichever spelling (``all_gather_single(out, in)``, ``all_gather(list, t)``,
    DeepSpeed's keyword calls) is used."""
    sizes, dtype = [0], None
    for value in (*args, *kwargs.values()):
        tensors = [value] if isinstance(value, torch.Tensor) else (
            [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (list, tuple)) else [])
        if tensors:
            sizes.append(sum(t.numel() for t in tensors))
            dtype = dtype or tensors[0].dtype
    return max(sizes), dtype


def _group_ranks(group) -> Optional[tuple[int, ...]]:
    """The global ranks of a call's ``group=`` (the default group when ``None``)."""
    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except (RuntimeError, ValueError):  # not initialised, or not a process group
        return None


def _peer(name: str, args, kwargs) -> Optional[int]:
    """The global rank an ``isend(tensor, dst)`` / ``irecv(tensor, src)`` addresses; None for other calls."""
    if name not in ("isend", "irecv"):
        return None
    peer = args[1] if len(args) > 1 else kwargs.get("dst" if name == "isend" else "src")
    return int(peer) if peer is not None else None


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
            self.calls.append(Call(name, *_full_size(args, kwargs), _group_ranks(kwargs.get("group")),
                                   _peer(name, args, kwargs)))
            return original(*args, **kwargs)

        return counted


def summarize(calls: list[Call]) -> dict[str, tuple[int, int, set]]:
    """name -> (number of calls, total elements, dtypes)."""
    summary: dict[str, tuple[int, int, set]] = {}
    for name, numel, dtype, *_ in calls:
        count, total, dtypes = summary.get(name, (0, 0, set()))
        summary[name] = (count + 1, total + numel, dtypes | {dtype})
    return summary
