"""What a ShardedOptimizer holds on this rank, in bytes, by kind and place: counted (:func:`memory_report`) or predicted
(:func:`estimate_memory`). Optimizer state is measured, not tabulated: each group's class (with offload's kernel) steps
a probe (3 elements; a whole-parameter class: each parameter's shape; a low-bit class: each piece's size), and each
state tensor counts per element, or per piece (one parameter's part of a rank's shard) for a scalar such as Adam's
``step``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Collection, Iterable, Literal, Optional, Union

import torch

from . import comm, optimizer_kinds, validation
from .layout import ParamSpec, build_layout, trainable_specs
from .offload import OffloadOption, host_optimizer_kwargs, refuse_capturable, resolve_offload, staging_sizes
from .precision import at_least_fp32


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one memory (device or host) by kind, each tensor counted once."""

    parameters: int = 0
    """Flat parameter buffers with padding; ``quantize_param_gather`` adds this rank's last all-gathered shard."""
    gradients: int = 0
    """Full-size ``param.grad`` (stage 1, from backward to step)."""
    gradient_shard: int = 0
    """The averaged gradient shard, reduce dtype (fp32 from a loss-scaled step to ``zero_grad()``, not estimated);
    offload: fp32 on the host, plus a device accumulator in ``accumulating()``."""
    master_weights: int = 0
    """fp32 (or wider) copies of this rank's shard; 0 for fp32 or fp64 parameters without offload or
    ``quantize_param_gather``."""
    optimizer_state: int = 0
    """Every tensor in the inner optimizers' state."""
    bucket_buffers: int = 0
    """Gradient buckets alive now; on the host, offload's staging buffers (16-bit models)."""

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held on this rank: on the parameters' ``device``, and on the ``host`` for offload (else zeros)."""

    device: StateBytes
    host: StateBytes

    @property
    def total(self) -> int:
        return self.device.total + self.host.total

    def as_dict(self) -> dict:
        return {"device": self.device.as_dict(), "host": self.host.as_dict(), "total": self.total}


def stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``tensor``'s memory: itself, or those a wrapper subclass flattens to, recursively."""
    if not hasattr(type(tensor), "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [leaf for name in names for leaf in stored_tensors(getattr(tensor, name))]


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors in ``tensors`` by what they store (:func:`stored_tensors`); non-tensors skipped."""
    leaves = {id(leaf): leaf for tensor in tensors if isinstance(tensor, torch.Tensor)
              for leaf in stored_tensors(tensor)}
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves.values())


def memory_report(held: dict[str, list[torch.Tensor]], offload: bool) -> MemoryReport:
    """The report of ``ShardedOptimizer.held_tensors()``; ``offload``: masters and optimizer state are on the host."""
    held_bytes = {kind: tensor_bytes(tensors) for kind, tensors in held.items()}
    device = StateBytes(parameters=held_bytes["parameters"], gradients=held_bytes["gradients"],
                        gradient_shard=held_bytes["gradient_shard"], bucket_buffers=held_bytes["bucket_buffers"],
                        master_weights=0 if offload else held_bytes["master_weights"],
                        optimizer_state=0 if offload else held_bytes["optimizer_state"])
    host = StateBytes(gradient_shard=held_bytes["host_gradient_shard"], bucket_buffers=held_bytes["host_staging"],
                      master_weights=held_bytes["master_weights"] if offload else 0,
                      optimizer_state=held_bytes["optimizer_state"] if offload else 0)
    return MemoryReport(device, host)


PROBE_NUMEL = 3


def optimizer_state_bytes(optimizer_class: type, optimizer_kwargs: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per element, bytes per parameter tensor) of ``optimizer_class``'s state for ``dtype`` tensors."""
    probe = torch.zeros(PROBE_NUMEL, dtype=dtype, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    optimizer = optimizer_class([probe], **optimizer_kwargs)
    optimizer.step()
    tensors = [value for value in optimizer.state[probe].values() if isinstance(value, torch.Tensor)]
    return (sum(tensor_bytes([value]) // PROBE_NUMEL for value in tensors if value.numel() == PROBE_NUMEL),
            sum(tensor_bytes([value]) for value in tensors if value.numel() != PROBE_NUMEL))


def whole_state_bytes(optimizer_class: type, optimizer_kwargs: dict, dtype: torch.dtype, shape: tuple) -> int:
    """State bytes for one ``shape`` parameter: a step on a meta tensor, or on zeros if the class reads values."""
    def stepped_on(device: str) -> int:
        probe = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        optimizer = optimizer_class([probe], **optimizer_kwargs)
        optimizer.step()
        return sum(tensor_bytes([v]) for v in optimizer.state[probe].values())

    try:
        return stepped_on("meta")
    except (NotImplementedError, RuntimeError):
        return stepped_on("cpu")


def shared_state_bytes(optimizer_class: type, optimizer_kwargs: dict, dtype: torch.dtype, numel: int) -> dict[str, int]:
    """By key, the bytes of state tensors shared between parameters (a low-bit class's quantization maps)."""
    probes = [torch.zeros(numel, dtype=dtype, requires_grad=True) for _ in range(2)]
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    optimizer = optimizer_class(probes, **optimizer_kwargs)
    optimizer.step()
    first, second = (optimizer.state[probe] for probe in probes)
    return {key: tensor_bytes([value]) for key, value in first.items()
            if torch.is_tensor(value) and value is second.get(key)}


def _groups_and_specs(params: Union[int, Iterable], dtype: torch.dtype, bucket_numel: int, optimizer_class: type,
                      optimizer_kwargs: dict, per_parameter: Collection[type]) -> tuple[list[dict], list, list]:
    """(param groups with their classes, trainable parameters (``None`` for a count), layout specs)."""
    if isinstance(params, int):
        if params <= 0:
            raise ValueError(f"the parameter count must be positive, got {params}")
        if _sharding(optimizer_class, per_parameter) == "whole":
            raise ValueError(f"{optimizer_class.__name__} is sharded by whole parameters, whose state and padding "
                             "depend on their shapes: pass the model's parameters or param groups, not a count")
        sizes = [bucket_numel] * (params // bucket_numel) + ([params % bucket_numel] if params % bucket_numel else [])
        group = {"optimizer": optimizer_class, **optimizer_kwargs}
        blocks = _blocks(group, per_parameter)
        return [group], [None] * len(sizes), [ParamSpec(0, str(dtype), size, blocks=blocks) for size in sizes]
    groups = optimizer_kinds.groups_with_classes(params, optimizer_class, optimizer_kwargs)
    work = [optimizer_kinds.step_work(g["optimizer"])
            if _sharding(g["optimizer"], per_parameter) == "whole" else None for g in groups]
    trainable, specs = trainable_specs(groups, work, [_blocks(g, per_parameter) for g in groups])
    if not specs:
        raise ValueError("no trainable parameters to estimate")
    return groups, trainable, specs


def _sharding(optimizer_class: type, per_parameter: Collection[type]) -> optimizer_kinds.Sharding:
    """As the optimizer shards the class; a class zeroimpl does not know is estimated flat."""
    return optimizer_kinds.sharding_of(optimizer_class, per_parameter,
                                       assume_elementwise=not optimizer_kinds.is_blockwise(optimizer_class))


def _blocks(group: dict, per_parameter: Collection[type]):
    return optimizer_kinds.blocks_of(group) if _sharding(group["optimizer"], per_parameter) == "blocked" else None


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def estimate_memory(params: Union[int, Iterable], world_size: int, stage: Literal[1, 2] = 2, *,
                    dtype: torch.dtype = torch.float32, offload: OffloadOption = None,
                    optimizer_class: type = torch.optim.AdamW, optimizer_kwargs: Optional[dict] = None,
                    reduce_dtype: Optional[torch.dtype] = None, bucket_numel: int = 2 ** 22,
                    rank: Optional[int] = None,
                    per_parameter: Collection[type] = (), quantize_param_gather: bool = False,
                    quantize_grad_reduce: bool = False) -> MemoryReport:
    """Predict :meth:`ShardedOptimizer.memory_report` of one rank at its peak of model states (after backward, all
    optimizer state allocated); activations and transient buffers excluded. ``params``: ShardedOptimizer's (exact),
    or a count of trainable ``dtype`` elements for a flat optimizer class (padding estimated). ``world_size``: the
    shard group's size. ``rank``: default, the one holding most. The rest: as ShardedOptimizer's."""
    quantize_param_gather = quantize_param_gather and comm.issues_collectives(world_size)  # (not at one rank)
    validation.check_stage(stage)
    policy = resolve_offload(offload)
    groups, trainable, specs = _groups_and_specs(params, dtype, bucket_numel, optimizer_class,
                                                 dict(optimizer_kwargs or {}), per_parameter)
    if policy is not None:
        refuse_capturable(groups)
    layout = build_layout(specs, world_size, bucket_numel)
    probes: dict = {}

    def piece_state(piece, shared_of_rank: dict) -> int:
        bucket = layout.buckets[piece.bucket_index]
        group, master_dtype = groups[bucket.group_index], at_least_fp32(_dtype(bucket.dtype))
        kwargs = {k: v for k, v in group.items() if k not in optimizer_kinds.OUTER_ONLY_KEYS}
        if policy is not None:
            kwargs = host_optimizer_kwargs(group["optimizer"], kwargs, set(), policy)
        kwargs.pop("capturable", None)  # probed on the host; capturable keeps the same state on the GPU
        whole = bucket.whole or bool(bucket.block)  # blocked: state by the piece's size (blocks, fp32 or 8-bit)
        shape = (tuple(trainable[piece.param_index].shape) if bucket.whole else (piece.length,)) if whole else None
        key = (group["optimizer"], repr(sorted(kwargs.items())), master_dtype, shape)
        if key not in probes:
            probes[key] = (whole_state_bytes(group["optimizer"], kwargs, master_dtype, shape) if whole
                           else optimizer_state_bytes(group["optimizer"], kwargs, master_dtype))
        if whole and optimizer_kinds.is_blockwise(group["optimizer"]):  # low-bit: shared maps count once per rank
            shared_key = (group["optimizer"], repr(sorted(kwargs.items())), master_dtype)
            blocks = specs[piece.param_index].blocks or optimizer_kinds.blocks_of(group)
            if shared_key not in probes:
                probes[shared_key] = shared_state_bytes(group["optimizer"], kwargs, master_dtype,
                                                        max(blocks.threshold, blocks.size))
            shared = probes[shared_key] if blocks.quantizes(piece.length) else {}
            shared_of_rank.update({(group["optimizer"], name): size for name, size in shared.items()})
            return probes[key] - sum(shared.values())
        if whole:
            return probes[key]
        per_element, per_tensor = probes[key]
        return per_element * piece.length + per_tensor

    parameters = full_gradients = shards = masters = 0
    state_of_rank = [0] * world_size
    for r in range(world_size):
        shared_of_rank: dict = {}  # (class, key) -> bytes of a state tensor shared by the rank's pieces
        for piece in layout.pieces(r):
            state_of_rank[r] += piece_state(piece, shared_of_rank)
        state_of_rank[r] += sum(shared_of_rank.values())
    for bucket in layout.buckets:
        param_dtype = _dtype(bucket.dtype)
        master_dtype = at_least_fp32(param_dtype)
        published = bucket.shard_numel if quantize_param_gather else 0
        parameters += param_dtype.itemsize * (bucket.padded_numel + published)
        full_gradients += param_dtype.itemsize * bucket.numel if stage == 1 else 0
        if policy is not None or master_dtype != param_dtype or quantize_param_gather:
            masters += master_dtype.itemsize * bucket.shard_numel
        shard_dtype = master_dtype if policy is not None else (reduce_dtype or master_dtype)
        shards += shard_dtype.itemsize * bucket.shard_numel
    state = max(state_of_rank) if rank is None else state_of_rank[rank]
    if policy is not None:
        staging = staging_sizes(layout, [_dtype(layout.buckets[s.bucket_index].dtype) for s in layout.slots])
        host = StateBytes(gradient_shard=shards, master_weights=masters, optimizer_state=state,
                          bucket_buffers=sum(2 * dtype.itemsize * numel for dtype, numel in staging.items()))
        return MemoryReport(StateBytes(parameters=parameters, gradients=full_gradients), host)
    device = StateBytes(parameters=parameters, gradients=full_gradients,
                        gradient_shard=shards if stage == 2 else 0,  # stage 1 reduces at step()
                        master_weights=masters, optimizer_state=state)
    return MemoryReport(device, StateBytes())
