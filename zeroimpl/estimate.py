"""Predict the model-state bytes a ShardedOptimizer holds per rank, before building one.

``estimate_memory`` answers "will it fit?" for a model (exact: it builds the same layout the optimizer
would) or for a bare parameter count (close: padding is estimated from bucket sizes). It predicts what
:meth:`ShardedOptimizer.memory_report` reports at the peak of model states in a training loop: right after
the backward passes of a step, once the optimizer state exists (every parameter stepped). Stage 1 then holds the full ``.grad`` (freed bucket by bucket as ``step()`` reduces
it into the shard); stage 2 holds the gradient shard instead. Transient bucket buffers (0 outside backward
and step) and activations are not model states and are not included.

Optimizer state is measured, not tabulated: the optimizer class takes one step on a 3-element tensor, and
each state tensor counts per element (same size as the parameter) or per piece -- the part of one
parameter in one rank's shard, which the inner optimizer sees as one tensor -- (a scalar such as Adam's
``step``). So any elementwise optimizer is predicted, with the kernel offload would choose.
"""

from __future__ import annotations

from typing import Iterable, Literal, Optional, Union

import torch

from . import validation
from .accounting import MemoryReport, StateBytes
from .layout import ParamSpec, build_layout, trainable_specs
from .offload import OffloadOption, host_optimizer_kwargs, resolve_offload

PROBE_NUMEL = 3


def optimizer_state_bytes(optimizer_class: type, optimizer_kwargs: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per element, bytes per parameter tensor) of ``optimizer_class``'s state for ``dtype`` tensors."""
    probe = torch.zeros(PROBE_NUMEL, dtype=dtype, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    optimizer = optimizer_class([probe], **optimizer_kwargs)
    optimizer.step()
    per_element = per_tensor = 0
    for value in optimizer.state[probe].values():
        if isinstance(value, torch.Tensor):
            if value.numel() == PROBE_NUMEL:
                per_element += value.element_size()
            else:
                per_tensor += value.numel() * value.element_size()
    return per_element, per_tensor


def _param_specs(params: Union[int, Iterable], dtype: torch.dtype, bucket_numel: int) -> list[ParamSpec]:
    """Layout input for a model's parameters or param groups (each with its own dtype), or for ``params``
    elements of ``dtype`` in one group."""
    if isinstance(params, int):
        if params <= 0:
            raise ValueError(f"the parameter count must be positive, got {params}")
        sizes = [bucket_numel] * (params // bucket_numel) + ([params % bucket_numel] if params % bucket_numel else [])
        return [ParamSpec(0, str(dtype), size) for size in sizes]
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    _, specs = trainable_specs(groups)
    if not specs:
        raise ValueError("no trainable parameters to estimate")
    return specs


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def estimate_memory(params: Union[int, Iterable], world_size: int, stage: Literal[1, 2] = 2, *,
                    dtype: torch.dtype = torch.float32, offload: OffloadOption = None,
                    optimizer_class: type = torch.optim.AdamW, optimizer_kwargs: Optional[dict] = None,
                    reduce_dtype: Optional[torch.dtype] = None, bucket_numel: int = 2 ** 22,
                    alignment: int = 8, rank: Optional[int] = None) -> MemoryReport:
    """Bytes per rank of a ShardedOptimizer with these settings, by kind and place (see module docstring).

    ``params``: the parameters or param groups you would pass to ``ShardedOptimizer`` (exact; each
    parameter's own dtype is used), or the number of trainable elements, all of ``dtype`` (padding
    estimated). ``rank``: the rank to predict (default: the one holding the most). The other arguments are
    ShardedOptimizer's. Ranks differ only in optimizer state: padding has none, and the state of one
    parameter's piece has a scalar (Adam's ``step``) per piece.
    """
    validation.check_stage(stage)
    policy = resolve_offload(offload)
    kwargs = dict(optimizer_kwargs or {})
    if policy is not None:
        kwargs = host_optimizer_kwargs(optimizer_class, kwargs, set(), policy)
    layout = build_layout(_param_specs(params, dtype, bucket_numel), world_size, bucket_numel, alignment)
    state_bytes = {}  # master dtype -> (per element, per tensor)
    parameters = full_gradients = shards = masters = 0
    state_of_rank = [0] * world_size
    pieces_of_rank = [{} for _ in range(world_size)]  # rank -> bucket index -> its pieces there
    for r, by_bucket in enumerate(pieces_of_rank):
        for piece in layout.pieces(r):
            by_bucket.setdefault(piece.bucket_index, []).append(piece)
    for bucket in layout.buckets:
        param_dtype = _dtype(bucket.dtype)
        master_dtype = torch.promote_types(param_dtype, torch.float32)
        if master_dtype not in state_bytes:
            state_bytes[master_dtype] = optimizer_state_bytes(optimizer_class, kwargs, master_dtype)
        per_element, per_tensor = state_bytes[master_dtype]
        parameters += _size(param_dtype) * bucket.padded_numel
        full_gradients += _size(param_dtype) * bucket.numel if stage == 1 else 0
        for r, pieces in enumerate(pieces_of_rank):
            mine = pieces.get(bucket.index, [])
            state_of_rank[r] += per_element * sum(p.length for p in mine) + per_tensor * len(mine)
        if policy is not None or master_dtype != param_dtype:
            masters += _size(master_dtype) * bucket.shard_numel
        shard_dtype = master_dtype if policy is not None else (reduce_dtype or master_dtype)
        shards += _size(shard_dtype) * bucket.shard_numel
    state = max(state_of_rank) if rank is None else state_of_rank[rank]
    if policy is not None:
        device = StateBytes(parameters=parameters, gradients=full_gradients)
        host = StateBytes(gradient_shard=shards, master_weights=masters, optimizer_state=state)
        return MemoryReport(device, host)
    device = StateBytes(parameters=parameters, gradients=full_gradients,
                        gradient_shard=shards if stage == 2 else 0,  # stage 1 reduces at step()
                        master_weights=masters, optimizer_state=state)
    return MemoryReport(device, StateBytes())
