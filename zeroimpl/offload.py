"""CPU offload (ZeRO-Offload, arXiv 2101.06840): this rank's optimizer shard lives and steps on the host: the masters
(:mod:`zeroimpl.buffers`) and averaged gradient shards (:mod:`zeroimpl.grad_shards`), in :func:`at_least_fp32` of the
parameters' dtype and page-locked when the parameters are on CUDA, and the inner optimizer's state beside them. The
device keeps only the parameters and transient gradient buckets; without a GPU the host is the "device" and copies are
synchronous. Stage 2, one micro-batch, CUDA, stepping bucket by bucket (:mod:`zeroimpl.param_sync`)::

    compute : --grad b0--|--grad b1--|--grad b2--|
    nccl    :            |--RS b0----|--RS b1----|--RS b2--|                           |AG b0  |AG b1  |AG b2  |
    copy    :                        |D2H b0|    |D2H b1|  |D2H b2|            |H2D b0 |H2D b1 |H2D b2 |
    host    :                                                     |sync|step b0|step b1|step b2|
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from .buffers import HALF_DTYPES
from .grad_shards import DeviceGradientShards, HostGradientShards
from .host_memory import HostArena
from .precision import at_least_fp32

# torch optimizers with a fused CPU kernel (torch >= 2.4); AdamW's: 2-6x its for-loop (benchmarks/results/host_step.md)
FUSED_CPU_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@dataclass(frozen=True)
class CPUOffload:
    """The ``offload`` policy; ``"cpu"`` is ``CPUOffload()``."""

    pin_memory: bool = True
    """Page-locked host memory, for asynchronous CUDA copies (ignored off CUDA). Forked processes do not inherit
    it: send them clones of a ``state_dict``'s host masters."""

    fused_step: bool = True
    """Use the fused CPU kernel (Adam, AdamW, SGD, Adagrad; last bits differ from the for-loop's) unless you pass
    ``fused``, ``foreach`` or ``differentiable``."""


OffloadOption = Union[None, Literal["cpu"], CPUOffload]


def resolve_offload(offload: "OffloadOption") -> Optional[CPUOffload]:
    if offload is None or isinstance(offload, CPUOffload):
        return offload
    if isinstance(offload, str) and offload == "cpu":
        return CPUOffload()
    raise ValueError(f"offload must be None, 'cpu' or zeroimpl.CPUOffload(...), got {offload!r}")


# keys that choose the kernel (or a mode fused kernels refuse), not the math: a user's choice keeps the step unfused
KERNEL_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def host_optimizer_kwargs(optimizer_class: type, kwargs: dict, group_keys: set, policy: CPUOffload) -> dict:
    """``kwargs`` with the fused kernel where it exists, unless a kernel or mode is chosen (``group_keys``: groups')."""
    if (policy.fused_step and issubclass(optimizer_class, FUSED_CPU_OPTIMIZERS)
            and not KERNEL_KEYS & (set(kwargs) | group_keys)):
        return {**kwargs, "fused": True}
    return kwargs


def refuse_capturable(settings: list[dict]) -> None:
    if any(setting.get("capturable") for setting in settings):
        raise ValueError("capturable=True keeps the optimizer's step count on the GPU for CUDA graphs, but with "
                         "offload='cpu' the optimizer steps on the host, where torch refuses it: drop capturable=True "
                         "(the host step needs no graph capture), or keep the state on the GPU (offload=None)")


def inner_kwargs(classes: list[type], optimizer_class: type, optimizer_kwargs: dict, groups: list[dict],
                 policy: Optional[CPUOffload]) -> dict[type, dict]:
    """Each inner class's constructor arguments: ``optimizer_kwargs`` for ``optimizer_class`` (other classes' groups
    carry theirs), with the fused host kernel where ``policy`` applies."""
    kwargs = {cls: dict(optimizer_kwargs) if cls == optimizer_class else {} for cls in classes}  # (the class checks)
    if policy is not None:
        refuse_capturable(groups)  # (they hold optimizer_kwargs too)
        for cls in kwargs:
            group_keys = {key for group in groups if group["optimizer"] is cls for key in group}
            kwargs[cls] = host_optimizer_kwargs(cls, kwargs[cls], group_keys, policy)
    return kwargs


def staging_sizes(layout, param_dtypes: list[torch.dtype]) -> dict[torch.dtype, int]:
    """Per 16-bit dtype in ``param_dtypes`` (by parameter index): its largest shard, its staging buffers' size."""
    sizes: dict[torch.dtype, int] = {}
    for bucket in layout.buckets:
        dtype = param_dtypes[bucket.param_indices[0]]
        if dtype in HALF_DTYPES:
            sizes[dtype] = max(sizes.get(dtype, 0), bucket.shard_numel)
    return sizes


def host_buffers(layout, param_dtypes: list[torch.dtype], pin_device: Optional[torch.device]
                 ) -> tuple[HostArena, list[torch.Tensor], list[torch.Tensor], dict[torch.dtype, list[torch.Tensor]]]:
    """Offload's host memory, slices of one :class:`HostArena` (page-locked for ``pin_device``): per bucket a
    master and a gradient shard, and per 16-bit dtype the two staging buffers of :func:`staging_sizes`."""
    buckets = len(layout.buckets)
    staging = staging_sizes(layout, param_dtypes)
    sizes = [(b.shard_numel, at_least_fp32(param_dtypes[b.param_indices[0]])) for b in layout.buckets] * 2
    sizes += [(numel, dtype) for dtype, numel in staging.items() for _ in range(2)]
    arena = HostArena(sizes, pin_device)
    masters, gradients, staged = arena.slices[:buckets], arena.slices[buckets:2 * buckets], arena.slices[2 * buckets:]
    return arena, masters, gradients, {dtype: staged[2 * k:2 * k + 2] for k, dtype in enumerate(staging)}


def gradient_store(policy: Optional[CPUOffload], layout, params: list[torch.nn.Parameter],
                   timeout: Optional[float] = None):
    """``(host arenas, host masters per bucket or None, gradient store, staging buffers per 16-bit dtype)``; with
    ``policy``, one arena and host shards whose waits for their copies ``timeout`` bounds."""
    device = params[0].device
    if policy is None:
        return [], None, DeviceGradientShards(len(layout.buckets)), {}
    pin = device if policy.pin_memory and device.type == "cuda" else None
    arena, masters, gradients, staging = host_buffers(layout, [p.dtype for p in params], pin)
    return [arena], masters, HostGradientShards(device, gradients, timeout), staging
