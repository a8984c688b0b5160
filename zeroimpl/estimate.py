"""Predict the model-state bytes a ShardedOptimizer holds per rank, before building one.

``estimate_memory`` answers "will it fit?" for a model (exact: it builds the same layout the optimizer
would) or for a bare parameter count (close: padding is estimated from bucket sizes). It predicts what
:meth:`ShardedOptimizer.memory_report` reports at the peak of model states in a training loop: right after
the backward passes of a step (``zero_grad()`` having been called after the previous one), once the
optimizer state exists. Stage 1 then holds the full ``.grad`` (freed bucket by bucket as ``step()`` reduces
it into the shard); stage 2 holds the gradient shard instead. Transient bucket buffers (0 outside backward
and step) and activations are not model states and are not included.

Optimizer state is measured, not tabulated: the optimizer class takes one step on a 3-element tensor, and
each state tensor counts per element (same size as the parameter) or per bucket (a scalar such as Adam's
``step``). So any elementwise optimizer is predicted, with the kernel offload would choose.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from .accounting import MemoryReport, StateBytes
from .layout import ParamSpec, build_layout
from .offload import CPUOffload, host_optimizer_kwargs, resolve_offload

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
    """Layout input for a model's parameters (or param groups), or for ``params`` elements in one group."""
    if isinstance(params, int):
        if params <= 0:
            raise ValueError(f"the parameter count must be positive, got {params}")
        sizes = [bucket_numel] * (params // bucket_numel) + ([params % bucket_numel] if params % bucket_numel else [])
        return [ParamSpec(0, str(dtype), size) for size in sizes]
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    specs, seen = [], set()
    for group_index, group in enumerate(groups):
        for param in group["params"]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                specs.append(ParamSpec(group_index, str(dtype), param.numel()))
    if not specs:
        raise ValueError("no trainable parameters to estimate")
    return specs


def estimate_memory(params: Union[int, Iterable], world_size: int, stage: int = 2, *,
                    dtype: torch.dtype = torch.float32, offload: Union[None, str, CPUOffload] = None,
                    optimizer_class: type = torch.optim.AdamW, optimizer_kwargs: Optional[dict] = None,
                    reduce_dtype: Optional[torch.dtype] = None, bucket_numel: int = 2 ** 22,
                    alignment: int = 8) -> MemoryReport:
    """Bytes per rank of a ShardedOptimizer with these settings, by kind and place (see module docstring).

    ``params``: the parameters or param groups you would pass to ``ShardedOptimizer`` (exact), or the
    number of trainable elements (padding estimated). ``dtype``: the model's parameter dtype. The other
    arguments are ShardedOptimizer's. Every rank holds the same bytes (shards are equal, padding included).
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    policy = resolve_offload(offload)
    kwargs = dict(optimizer_kwargs or {})
    if policy is not None:
        kwargs = host_optimizer_kwargs(optimizer_class, kwargs, set(), policy)
    specs = _param_specs(params, dtype, bucket_numel)
    layout = build_layout(specs, world_size, bucket_numel, alignment)
    shard = layout.shard_numel  # elements of this rank's shard, all buckets
    buckets = len(layout.buckets)
    master_dtype = torch.promote_types(dtype, torch.float32)
    master_size = torch.empty((), dtype=master_dtype).element_size()
    per_element, per_tensor = optimizer_state_bytes(optimizer_class, kwargs, master_dtype)
    param_size = torch.empty((), dtype=dtype).element_size()

    parameters = param_size * layout.padded_numel
    full_gradients = param_size * sum(s.numel for s in specs) if stage == 1 else 0
    state = per_element * shard + per_tensor * buckets
    separate_master = policy is not None or master_dtype != dtype
    masters = master_size * shard if separate_master else 0
    if policy is not None:
        device = StateBytes(parameters=parameters, gradients=full_gradients)
        host = StateBytes(gradient_shard=master_size * shard, master_weights=masters, optimizer_state=state)
        return MemoryReport(device, host)
    shard_size = torch.empty((), dtype=reduce_dtype or master_dtype).element_size()
    device_shard = shard_size * shard if stage == 2 else 0  # stage 1 reduces at step()
    device = StateBytes(parameters=parameters, gradients=full_gradients, gradient_shard=device_shard,
                        master_weights=masters, optimizer_state=state)
    return MemoryReport(device, StateBytes())
