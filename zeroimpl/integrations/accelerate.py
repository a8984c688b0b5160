"""Hugging Face accelerate: one call in place of ``accelerator.prepare``.

    from zeroimpl.integrations.accelerate import prepare
    optimizer = ShardedOptimizer(param_groups, torch.optim.AdamW, stage=2, lr=3e-4)   # over the model where it trains
    model, optimizer, dataloader, scheduler = prepare(accelerator, model, optimizer, dataloader, scheduler)

``accelerator.prepare`` cannot take a :class:`zeroimpl.ShardedOptimizer`: it moves the model to its device (on CPU
``cpu:0``, and ``tensor.to("cpu:0")`` copies every parameter out of the optimizer's flat buffers) and wraps it in
DistributedDataParallel, which would all-reduce every gradient the optimizer already reduce-scatters. Its
``save_state`` writes ``optimizer.state_dict()`` from the main process alone, which for a sharded optimizer is rank
0's shard: every other rank's would be lost. :func:`prepare` keeps everything else of accelerate's:

* **The model** is the model itself, never moved and never wrapped in DDP (as accelerate returns it on one
  process, so ``accelerator.unwrap_model`` and ``get_state_dict`` keep working), with autocast for
  ``mixed_precision="bf16"`` applied by accelerate. Of DDP it keeps two behaviours: ``model.no_sync`` is
  :meth:`ShardedOptimizer.accumulating` (what ``accelerator.accumulate(model)`` and ``accelerator.no_sync(model)``
  enter on non-final micro-batches), and rank 0's buffers are broadcast before training forwards when DDP
  broadcasts them (:func:`zeroimpl.broadcast_buffers`, which leaves forwards without gradients alone, so that the
  main process may run the model by itself; ``DistributedDataParallelKwargs(broadcast_buffers=False)`` turns it
  off).
* **The optimizer** is an :class:`AcceleratedShardedOptimizer`: accelerate's ``AcceleratedOptimizer`` (``step`` and
  ``zero_grad`` skipped on non-final micro-batches, the GradScaler's skipped steps seen by the scheduler) without
  device placement, registered with the accelerator so that the scheduler is tied to it. ``accelerator.backward``,
  ``clip_grad_norm_`` and ``clip_grad_value_`` work unchanged: ``param.grad`` is the averaged gradient.
* **The dataloader and the scheduler** are prepared by accelerate, as with DDP.
* **Checkpoints**: ``accelerator.save_state(dir)`` has every rank write its own shard to ``dir/zeroimpl`` through
  :func:`zeroimpl.checkpoint.save_checkpoint` (a hook accelerate runs on every process), and ``optimizer.bin``
  only names that folder; ``accelerator.load_state(dir)`` restores the optimizer and the model from the shards
  (:func:`zeroimpl.checkpoint.load_checkpoint`, on any world size) and refuses a folder without them. The rest
  (scheduler, RNG states, ``model.safetensors``, dataloader samplers) is accelerate's own.
* **Saving the model**: the parameters are views of the optimizer's flat buckets, and accelerate keeps one tensor
  per storage in a safetensors file, so ``accelerator.save_model(model, dir)`` would write one per bucket. The
  ``model.safetensors`` of ``save_state`` is made whole here (:func:`_save_shards`); elsewhere save with
  ``accelerator.unwrap_model(model).save_pretrained(dir)`` or ``save_model(..., safe_serialization=False)``.

Only a ShardedOptimizer is accepted: a plain torch optimizer is refused, not converted, because the scheduler
given with it already holds it (and a converted one would leave the user's own reference stepping nothing).
"""

from __future__ import annotations

import collections
import functools
import os
import weakref
import accelerate
import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DDPCommunicationHookType, DistributedType

from zeroimpl import ShardedOptimizer, broadcast_buffers, sync_module_states
from zeroimpl.module_buffers import no_sync
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

CHECKPOINT_SUBDIR = "zeroimpl"  # the first optimizer's shards in a save_state folder; the next "zeroimpl_1", ...
SHARDS_KEY = "zeroimpl_sharded_checkpoint"  # optimizer.bin's only key: the folder beside it with the shards

# accelerator -> its AcceleratedShardedOptimizers, in the order prepare() met them (their checkpoint folders)
_PREPARED: "weakref.WeakKeyDictionary[accelerate.Accelerator, list[weakref.ref]]" = (
    weakref.WeakKeyDictionary())


class AcceleratedShardedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a :class:`zeroimpl.ShardedOptimizer`, made by :func:`prepare`.

    ``step``, ``zero_grad``, ``param_groups`` and ``step_was_skipped`` are accelerate's; ``self.optimizer`` is the
    ShardedOptimizer. ``state_dict()`` and ``load_state_dict()`` are for ``accelerator.save_state`` and
    ``load_state`` only, whose hooks move the shards through the checkpoint API: outside them ``state_dict()``
    raises, since one rank's shard saved from the main process would lose all the others. Invariant:
    ``saving`` is true only between ``save_state``'s hook and its ``state_dict()`` call, ``restored`` only
    between ``load_state``'s hook and its ``load_state_dict()`` call.
    """

    def __init__(self, optimizer: ShardedOptimizer, model: torch.nn.Module, checkpoint_subdir: str, scaler=None):
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self.model = model  # the bare model, as the checkpoint API saves and restores it
        self.checkpoint_subdir = checkpoint_subdir
        self.saving = False
        self.restored = False
        # accelerate's mark of an object it has prepared (no public seam): Accelerator.prepare then registers this
        # wrapper as it is, instead of wrapping it again with device placement
        self._is_accelerate_prepared = True

    def state_dict(self) -> dict:
        if not self.saving:
            raise RuntimeError(
                "optimizer.state_dict() of a ShardedOptimizer holds this rank's shard only (saved from the main "
                "process, every other rank's shard would be lost): save with accelerator.save_state(dir) on every "
                "process, or zeroimpl.checkpoint.save_checkpoint(dir, optimizer.optimizer, model); "
                "optimizer.optimizer.state_dict() is this rank's shard, to save on every rank")
        self.saving = False
        return {SHARDS_KEY: self.checkpoint_subdir}

    def load_state_dict(self, state_dict: dict) -> None:
        if SHARDS_KEY not in state_dict:  # a state of optimizer.optimizer.state_dict(): the core checks it
            self.optimizer.load_state_dict(state_dict)
            return
        if not self.restored:
            raise RuntimeError(
                f"this state names the shards in {state_dict[SHARDS_KEY]!r} beside it and holds no optimizer "
                "state: load it with accelerator.load_state(dir) after zeroimpl.integrations.accelerate.prepare")
        self.restored = False


def prepare(accelerator: accelerate.Accelerator, *objects):
    """``accelerator.prepare(*objects)`` with each model passed beside its :class:`zeroimpl.ShardedOptimizer`. Call
    it on every process.

    Returns what ``accelerator.prepare`` does, but each model unmoved and unwrapped, and each ShardedOptimizer as an
    :class:`AcceleratedShardedOptimizer`: ``save_state`` / ``load_state`` keep every rank's shard.

    Raises, before changing anything, ``TypeError`` for a plain torch optimizer and ``ValueError`` for: a model
    without exactly one ShardedOptimizer in the call, or an optimizer without its model; a model off
    ``accelerator.device`` or prepared before; DeepSpeed, FSDP, Megatron-LM or a DDP communication hook; an
    accelerator whose process count is not the process group's (on CPU: ``Accelerator(cpu=True)``).
    """
    _check_accelerator(accelerator)
    plain = [o for o in objects if isinstance(o, torch.optim.Optimizer) and not isinstance(o, ShardedOptimizer)]
    if plain:
        raise TypeError(
            "zeroimpl.integrations.accelerate.prepare takes a zeroimpl.ShardedOptimizer, got "
            f"{type(plain[0]).__name__}: build ShardedOptimizer(param_groups, torch.optim.AdamW, stage=2, lr=...) over the model's parameters "
            "(the same groups and hyperparameters) and the scheduler over it. A plain optimizer is not converted: "
            "the scheduler already holds it")
    optimizer_of = _pair_models_with_optimizers(objects)
    for model in optimizer_of:
        _check_model(accelerator, model)
    prepared = {}
    for model, optimizer in optimizer_of.items():
        prepared[id(model)] = _prepare_model(accelerator, model, optimizer)
        prepared[id(optimizer)] = _wrap_optimizer(accelerator, optimizer, model)
    return accelerator.prepare(*(prepared.get(id(o), o) for o in objects))


def _check_accelerator(accelerator: accelerate.Accelerator) -> None:
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(f"accelerate runs {accelerator.distributed_type.value}, which shards the model itself: with "
                         "a zeroimpl.ShardedOptimizer, run accelerate without DeepSpeed, FSDP or Megatron-LM")
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
        raise ValueError(f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook.value!r}) is a hook for DDP's "
                         "all-reduce, which zeroimpl replaces; remove it (zeroimpl's quantize_grad_reduce=True "
                         "compresses its own reduce-scatter)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if accelerator.num_processes != world:
        raise ValueError(
            f"accelerate sees {accelerator.num_processes} process(es) but the process group holds {world}, so it "
            "would neither shard the data nor scale the schedule as for data parallelism: on CPU, create "
            "Accelerator(cpu=True) or launch with accelerate launch --cpu (ACCELERATE_USE_CPU=true)")


def _pair_models_with_optimizers(objects) -> dict[torch.nn.Module, ShardedOptimizer]:
    """Each model with trainable parameters -> the one ShardedOptimizer among ``objects`` that holds them."""
    optimizers = [o for o in objects if isinstance(o, ShardedOptimizer)]
    pairs, paired = {}, set()
    for model in (o for o in objects if isinstance(o, torch.nn.Module)):
        if not any(p.requires_grad for p in model.parameters()):
            continue  # accelerate prepares a frozen model as ever (never wrapped: nothing to reduce)
        owners = [o for o in optimizers if o.trains(model)]
        if len(owners) != 1:
            raise ValueError(
                f"{type(model).__name__} has trainable parameters and {len(owners)} ShardedOptimizers over them "
                "among the objects: pass each model with the one ShardedOptimizer that trains it to the same "
                "prepare call (a model trained with DDP goes to accelerator.prepare, separately)")
        pairs[model] = owners[0]
        paired.add(id(owners[0]))
    unpaired = [o for o in optimizers if id(o) not in paired]
    if unpaired:
        raise ValueError("a ShardedOptimizer was passed without the model it trains: pass the model to the same "
                         "prepare call, so that its no_sync() and buffers are set up with it")
    return pairs


def _check_model(accelerator: accelerate.Accelerator, model: torch.nn.Module) -> None:
    if getattr(model, "_is_accelerate_prepared", False):  # accelerate's mark of a prepared model (no public seam)
        raise ValueError(f"{type(model).__name__} was prepared already (by accelerate or by this function): "
                         "prepare each model once")
    target = accelerator.device
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not _same_device(tensor.device, target):
            raise ValueError(
                f"{name} is on {tensor.device}, but the accelerator trains on {target}: prepare() does not move a "
                "model that a ShardedOptimizer trains. Call model.to(accelerator.device) before prepare()")


def _same_device(device: torch.device, target: torch.device) -> bool:
    """One device: ``cpu`` and ``cpu:0`` are the same; an index left out (``torch.device("cuda")``) matches any."""
    if device.type != target.type:
        return False
    return device.type == "cpu" or device.index is None or target.index is None or device.index == target.index


def _prepare_model(accelerator: accelerate.Accelerator, model: torch.nn.Module,
                   optimizer: ShardedOptimizer) -> torch.nn.Module:
    """The model as it trains: DDP's broadcasts, ``no_sync`` as the optimizer's accumulation, accelerate's autocast
    (and torch.compile, if configured); not moved, not wrapped."""
    sync_module_states(model)  # rank 0's parameters (frozen ones too) and buffers, as DDP's constructor
    handler = accelerator.ddp_handler
    # DDP's default, as accelerate would have wrapped it
    buffers = broadcast_buffers(model) if handler is None or handler.broadcast_buffers else None
    prepared = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    # what accelerator.no_sync(model) and accumulate(model) enter, as they enter DDP's
    prepared.no_sync = functools.partial(no_sync, [optimizer], buffers)
    return prepared


def _wrap_optimizer(accelerator: accelerate.Accelerator, optimizer: ShardedOptimizer,
                    model: torch.nn.Module) -> AcceleratedShardedOptimizer:
    registered = _PREPARED.get(accelerator)
    if registered is None:
        registered = _PREPARED[accelerator] = []
        accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: _save_shards(
            accelerator, _still_prepared(accelerator, registered), models, weights, output_dir))
        accelerator.register_load_state_pre_hook(
            lambda models, input_dir: _load_shards(_still_prepared(accelerator, registered), models, input_dir))
    subdir = CHECKPOINT_SUBDIR if not registered else f"{CHECKPOINT_SUBDIR}_{len(registered)}"
    # the GradScaler of fp16 on accelerators, as accelerate would pass it (on CPU accelerate trains fp16 in fp32)
    wrapped = AcceleratedShardedOptimizer(optimizer, model, subdir, scaler=accelerator.scaler)
    registered.append(weakref.ref(wrapped))
    return wrapped


def _still_prepared(accelerator: accelerate.Accelerator, registered: list) -> list[AcceleratedShardedOptimizer]:
    """The optimizers prepare() met that the accelerator still holds, in that order: ``free_memory()`` (as
    ``find_executable_batch_size`` calls before a retry) lets go of them, and then they are neither kept alive
    here nor saved. (accelerate's ``_optimizers``: no public seam.)"""
    alive = [reference() for reference in registered]
    return [o for o in alive if o is not None and any(o is held for held in accelerator._optimizers)]


def _save_shards(accelerator: accelerate.Accelerator, optimizers: list[AcceleratedShardedOptimizer], models: list,
                 weights: list, output_dir: str) -> None:
    """save_state's hook, run on every process before accelerate writes its files: every rank writes its shard.

    ``weights`` holds the state dict of each of ``models``, which the writing process saves as
    ``model.safetensors``. A ShardedOptimizer's parameters are views of its flat buckets, and accelerate keeps one
    tensor per storage in a safetensors file (it drops the rest as tied weights), so that process's state dicts
    of these models are replaced by copies with a storage per tensor (tied weights still sharing one).
    """
    configuration = accelerator.project_configuration
    writes = accelerator.is_local_main_process if configuration.save_on_each_node else accelerator.is_main_process
    for optimizer in optimizers:
        save_checkpoint(os.path.join(output_dir, optimizer.checkpoint_subdir), optimizer.optimizer, optimizer.model)
        optimizer.saving = True
        for index, model in enumerate(models):
            if writes and _is_or_wraps(model, optimizer.model):
                weights[index] = _unaliased(weights[index])


def _unaliased(state: dict) -> collections.OrderedDict:
    """``state`` with each tensor copied into a storage of its own; tensors of the same data, shape and strides
    (tied weights) share one copy."""
    copies, unaliased = {}, collections.OrderedDict()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            unaliased[name] = tensor
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in copies:
            copies[key] = tensor.clone()
        unaliased[name] = copies[key]
    return unaliased


def _load_shards(optimizers: list[AcceleratedShardedOptimizer], models: list, input_dir: str) -> None:
    """load_state's hook, run on every process before accelerate reads its files: restore each optimizer and its
    model from the shards, and put a :class:`RestoredFromShards` in the model's place in the list accelerate loads
    ``model.safetensors`` into (loading it would overwrite the parameters behind the restored master weights;
    taking the model off the list would shift the models after it onto other models' files)."""
    for optimizer in optimizers:
        load_checkpoint(os.path.join(input_dir, optimizer.checkpoint_subdir), optimizer.optimizer, optimizer.model,
                        missing=f"{input_dir} has no {optimizer.checkpoint_subdir}/ folder of zeroimpl shards: it was "
                        "not saved by accelerator.save_state after zeroimpl.integrations.accelerate.prepare (a DDP "
                        "run's optimizer.bin holds another optimizer's state), so the optimizer cannot resume from it")
        optimizer.restored = True
        models[:] = [RestoredFromShards() if _is_or_wraps(m, optimizer.model) else m for m in models]


class RestoredFromShards(torch.nn.Module):
    """Stands in for a model that its shards restored, at its position in the list of models ``load_state`` loads
    (accelerate names their files by position): it holds nothing and loads nothing."""

    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return [], []  # (missing keys, unexpected keys), as torch's


def _is_or_wraps(prepared: torch.nn.Module, model: torch.nn.Module) -> bool:
    """``prepared`` is ``model``, or torch.compile's wrapper of it (what prepare_model returns with dynamo on)."""
    return prepared is model or getattr(prepared, "_orig_mod", None) is model


__all__ = ["prepare", "AcceleratedShardedOptimizer", "CHECKPOINT_SUBDIR"]
