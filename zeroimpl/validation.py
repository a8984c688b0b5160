"""Checks of user input that turn silent corruption or hangs into clear errors at construction."""

from __future__ import annotations

import gc
import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .memory_format import dense_strides
from .precision import LossScaleConfig

FRAMEWORK_ROUTES = (
    "In a framework, use its zeroimpl route: PyTorch Lightning and Fabric: strategy=\"zero2\" (or \"zero1\", "
    "\"zero2_offload\") after `import zeroimpl.integrations.lightning`; accelerate: "
    "zeroimpl.integrations.accelerate.prepare(accelerator, model, optimizer, ...) instead of accelerator.prepare; "
    "transformers' Trainer and its subclasses (TRL, PEFT): zeroimpl.integrations.trainer.ZeroTrainer, "
    "e.g. class ZeroSFTTrainer(ZeroTrainer, SFTTrainer)")


def check_options(stage, loss_scale, nonfinite, collective_timeout, max_inflight_buckets, verify_every,
                  quantize_grad_reduce=False, init_sync: str = "broadcast") -> None:
    """Refuse an option out of range, naming what it accepts."""
    if quantize_grad_reduce not in (False, True, "replicas"):
        raise ValueError(f"quantize_grad_reduce must be False, True or 'replicas', got {quantize_grad_reduce!r}")
    check_stage(stage)
    if not (loss_scale is None or loss_scale == "auto" or isinstance(loss_scale, LossScaleConfig)):
        raise ValueError(f"loss_scale must be 'auto' (on for fp16 parameters), None (off) or "
                         f"zeroimpl.LossScaleConfig(...) (on), got {loss_scale!r}")
    if nonfinite not in ("raise", "skip"):
        raise ValueError(f"nonfinite must be 'raise' (stop with FloatingPointError on NaN/Inf gradients) or "
                         f"'skip' (skip such steps and count them), got {nonfinite!r}")
    check_timeout(collective_timeout)
    if max_inflight_buckets < 0:
        raise ValueError(f"max_inflight_buckets must be >= 0, got {max_inflight_buckets}")
    check_verify_every(verify_every)
    if init_sync not in ("broadcast", "check"):
        raise ValueError(f"init_sync must be 'broadcast' (rank 0's parameters overwrite the others', as DDP does at "
                         f"construction) or 'check' (raise if the ranks' parameters differ), got {init_sync!r}")


# arguments of torch's ZeroRedundancyOptimizer and FairScale's OSS that mean nothing here -> why, and what to do
PEER_ARGUMENTS = {
    "parameters_as_bucket_view": "the parameters always live in flat buckets here (bucket_numel sets their size)",
    "overlap_with_ddp": ("under DDP, stage 1 steps after DDP's all-reduce; to overlap the reduction with backward, "
                         "drop the DDP wrap and use stage=2"),
    "broadcast_buffer_size": "the parameters' all-gather is bucketed by bucket_numel",
    "broadcast_fp16": "to send the parameters in 8 bits, pass quantize_param_gather=True",
    "force_broadcast_object": "the optimizer sends no Python objects while training",
    "group": "pass process_group= (or device_mesh=)",
    "optim": "pass the torch optimizer class as optimizer_class, the second argument",
}


def refuse_peer_arguments(optimizer_kwargs: dict) -> None:
    """Refuse ZeroRedundancyOptimizer's and OSS's arguments, which would reach the inner optimizer unnoticed."""
    for name in optimizer_kwargs:
        if name in PEER_ARGUMENTS:
            raise TypeError(f"ShardedOptimizer takes no {name!r} (an argument of torch's ZeroRedundancyOptimizer or "
                            f"FairScale's OSS): {PEER_ARGUMENTS[name]}")


def check_stage(stage) -> None:
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (shard optimizer state) or 2 (also shard gradients), got {stage!r}")


def check_process_group(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ShardedOptimizer needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment; "
                           "use backend='nccl' on GPUs, 'gloo' on CPU), even for a single process")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the process_group passed to ShardedOptimizer; "
                         "create the optimizer only on ranks of that group")


def check_timeout(timeout) -> None:
    if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                    and 0 < timeout < float("inf")):
        raise ValueError(f"collective_timeout must be None (the process group's timeout) or a finite number of "
                         f"seconds > 0, got {timeout!r}")


def check_verify_every(verify_every) -> None:
    if verify_every is not None and not (isinstance(verify_every, int) and not isinstance(verify_every, bool)
                                         and verify_every >= 1):
        raise ValueError(f"verify_every must be None (never) or a number of steps >= 1, got {verify_every!r}")


def held_by_ddp(params: list[torch.Tensor]) -> set[int]:
    """The ``id``s of the parameters that torch's DDP wrappers holding any of ``params`` average (stage 1 then takes
    their averaged gradients, as ZeroRedundancyOptimizer does); empty if none holds one. Two scans of live objects,
    a hit rechecked after ``gc.collect()`` (a dropped wrapper counts on no rank)."""
    if _held_by_ddp(params):
        gc.collect()
        return _held_by_ddp(params)
    return set()


DDP_STATE_DICT_MESSAGE = (
    "under DistributedDataParallel, a stage-1 ShardedOptimizer keeps its state as torch's ZeroRedundancyOptimizer "
    "does, a shard per rank, and state_dict() gives the full state only after a consolidation: call "
    "optimizer.consolidate_state_dict(to=0) on every rank first, then state_dict() on rank 0 (Lightning's "
    "strategy=\"ddp\" does so itself), or save every rank's shard with zeroimpl.checkpoint.save_checkpoint. A "
    "framework that saves optimizer.state_dict() from its main process alone (accelerate's save_state, "
    "transformers' Trainer) would keep one rank's shard and lose the others'. " + FRAMEWORK_ROUTES)

DDP_STAGE_2_MESSAGE = (
    "the model is wrapped in DistributedDataParallel, which all-reduces every full gradient and keeps it in "
    "param.grad, so stage 2 has no gradient left to shard (and would reduce each one a second time). Either keep the "
    "DDP wrap and use stage=1 (the ZeroRedundancyOptimizer way: DDP averages the gradients, the optimizer steps its "
    "shard and all-gathers the parameters), or drop the DDP wrap and call the bare model (stage 2 then "
    "reduce-scatters the gradients itself during backward). " + FRAMEWORK_ROUTES)


def _held_by_ddp(params: list[torch.Tensor]) -> set[int]:
    """The ``id``s of the parameters that each DistributedDataParallel (alive or not yet collected) holding one of
    ``params`` averages: its ``_module_parameters``, which leave out those it ignores."""
    ours, held, objects = {id(param) for param in params}, set(), gc.get_objects()
    kinds = [kind for kind in set(map(type, objects)) if issubclass(kind, DistributedDataParallel)]  # (C speed)
    for wrapper in objects if kinds else ():
        if type(wrapper) in kinds:  # (type: isinstance would follow a dead weak proxy)
            averaged = {id(param) for param in wrapper._module_parameters}
            if averaged & ours:
                held |= averaged
    return held


def outside_ddp_message(indices: list[int]) -> str:
    """Why stage 1 under DDP refuses trainable parameters (by index) that no DDP wrapper averages."""
    return (f"{len(indices)} trainable parameter(s) of this ShardedOptimizer (indices {sorted(indices)[:8]}) are not "
            "averaged by DistributedDataParallel (outside the wrapped module, or ignored by it), yet under DDP stage 1 "
            "steps from DDP's averaged param.grad, so they would be stepped from one rank's own gradient. Either "
            "wrap every parameter the optimizer holds in the DDP module, give those parameters an optimizer of their "
            "own, or drop the DDP wrap (ShardedOptimizer then averages every gradient itself). " + FRAMEWORK_ROUTES)


def check_params(params: list[torch.Tensor], topology, layout: Optional[dict] = None, values: bool = True) -> None:
    """Local checks, then a collective one that every rank holds the same parameters (shapes, strides and float64
    checksums, compared as ``max(x) == -max(-x)``) and ``layout`` (a fingerprint), on a device the collectives reach
    (a CPU model under NCCL: the GPU); ``values=False``: shapes only."""
    check_local_params(params)
    device = topology.reaching(params[0].device)
    layout_digest = int(hashlib.sha256(repr(layout).encode()).hexdigest()[:12], 16)  # 48 bits: exact in fp64
    shapes = torch.tensor([len(params), sum(p.numel() for p in params),
                           hash(tuple((tuple(p.shape), dense_strides(p)) for p in params)) % (2 ** 50), layout_digest],
                          dtype=torch.float64, device=device)
    _raise_if_ranks_differ(shapes, topology, "the number, shapes or memory formats (strides: channels_last, a "
                           "transposed weight) of the trainable parameters, or the shard "
                           "layout (param groups, their optimizer classes, per_parameter, bucket_numel, "
                           "quantize_param_gather, quantize_grad_reduce)",
                           "build the same model, with the same options, on every rank")
    if not values:
        return
    with torch.no_grad():
        sums = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                            for p in params]).flatten().to(device)
    _raise_if_ranks_differ(sums, topology, "the values of the parameters (init_sync='check')",
                           "leave init_sync at 'broadcast' (the default: rank 0's parameters overwrite the others', "
                           "as DDP does at construction), or load the same weights on every rank before building "
                           "the optimizer. Seeding every rank alike gives equal weights too, but if that generator "
                           "also draws the batches (nanoGPT seeds 1337 + rank), every rank then trains on the same "
                           "data")


def placement_problem(params: list[torch.Tensor], group) -> Optional[str]:
    """Why ``group``'s collectives cannot reach ``params`` now (a CPU model under NCCL: it may still move), or None."""
    device = params[0].device
    if dist.get_backend(group) != "nccl" or device.type == "cuda":
        return None
    return (f"the process group's backend is nccl but the parameters are on {device}: move the model to its GPU "
            "(model.to(f'cuda:{local_rank}')) before its first backward, step or load, or use backend='gloo' for CPU "
            "training")


def check_local_params(params: list[torch.Tensor]) -> None:
    """Trainable ``params`` that one rank can shard: some, with storage, on one device, floating point."""
    if not params:
        raise ValueError("ShardedOptimizer got no trainable parameters (all have requires_grad=False?)")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}; move the model to one "
                         "device (model.to(device)) before building ShardedOptimizer")
    if params[0].is_meta:
        raise ValueError("the parameters are on the meta device (no storage yet): materialize the model first "
                         "(model.to_empty(device=...) and load or initialize its weights), then build ShardedOptimizer "
                         "(a torch optimizer built before to_empty() would hold the old meta parameters too)")
    for p in params:
        if not p.dtype.is_floating_point:
            raise ValueError(f"a trainable parameter has dtype {p.dtype}; only floating-point parameters can "
                             "be optimized")


def _raise_if_ranks_differ(values: torch.Tensor, topology, what: str, fix: str) -> None:
    if not topology.same_on_every_rank(values, "construction check all-reduce").all():
        raise RuntimeError(f"ranks differ in {what} at ShardedOptimizer construction: {fix}")
