"""Are the ranks' parameters still bit-identical, as data parallelism needs (:func:`verify_ranks_agree`, every
``verify_every`` steps or on demand)? A rank-dependent edit, another seed or a corrupted update breaks that silently."""

from __future__ import annotations

from typing import Callable

import torch

from .buffers import BucketStorage
from .pending import CollectiveError
from .topology import Topology


class DivergenceError(CollectiveError):
    """The ranks' parameters differ (``verify_every``, ``verify_ranks_agree()``)."""


def verify_ranks_agree(storages: list[BucketStorage], frozen: list[torch.Tensor], topology: Topology,
                       device: torch.device, step: int, name_of: Callable[[torch.Tensor], str]) -> None:
    """Raise :class:`DivergenceError` on every rank unless all hold bit-identical bucket and ``frozen`` parameters.
    Collective: one all-reduce of a checksum per bucket and frozen parameter (:meth:`Topology.same_on_every_rank`),
    then one of a checksum per parameter of the differing buckets, to find the first (``name_of`` names it)."""
    def same_on_every_rank(checksums: torch.Tensor) -> list[bool]:
        return topology.same_on_every_rank(checksums.to(device), "parameter checksum all-reduce").tolist()

    flat_frozen = [p.detach().reshape(-1) for p in frozen]
    same = same_on_every_rank(torch.stack([bit_checksum(t).to(device)  # a frozen member may live elsewhere
                                           for t in [s.param_buffer for s in storages] + flat_frozen]))
    suspects = [p for s, agree in zip(storages, same) if not agree for p in s.params]
    if suspects:
        per_param = torch.stack([bit_checksum(p.detach().reshape(-1)) for p in suspects])
        first = next(p for p, agree in zip(suspects, same_on_every_rank(per_param)) if not agree)
    elif not all(same):
        first = frozen[same.index(False, len(storages)) - len(storages)]
    else:
        return
    raise DivergenceError(
        f"the ranks hold different parameters after step {step}: {name_of(first)} differs ({same.count(False)} "
        "bucket(s) or frozen parameter(s) in all). Data-parallel ranks must stay identical; usual causes: "
        "rank-dependent code that edits parameters, a different model or seed on some rank, or a corrupted "
        "update. Restart from the last checkpoint; if it recurs, find what edits that parameter")


def bit_checksum(flat: torch.Tensor) -> torch.Tensor:
    """A wrapping int64 sum of a contiguous 1-D tensor's bits, read as integers of the element's width (complex128:
    pairs of int64): any one changed element of at most 8 bytes changes it."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.int64)
    return flat.view(as_int).sum(dtype=torch.int64)


def param_name(param_groups: list[dict], param: torch.Tensor) -> str:
    """A parameter's name (when the groups came from ``model.named_parameters()``) or position, and shape."""
    for group_index, group in enumerate(param_groups):
        for position, member in enumerate(group["params"]):
            if member is param:
                names = group.get("param_names")
                where = repr(names[position]) if names else f"parameter {position} of param group {group_index}"
                return f"{where} (shape {tuple(param.shape)})"
    return f"a parameter of shape {tuple(param.shape)}"
