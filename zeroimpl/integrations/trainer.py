"""Hugging Face Trainer with zeroimpl: ZeRO stage 1/2 and CPU offload by changing two lines of a script.

    from zeroimpl.integrations.trainer import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=args, train_dataset=..., zero_stage=2, zero_offload=None)

How it fits Trainer (transformers 5), and the traps it avoids:

* **No DDP.** ``_wrap_model`` returns a :class:`ShardedModule` around the model, so Trainer does not hand
  the model to accelerate's ``prepare`` (which would wrap it in DDP: an all-reduce of every gradient and
  full-size DDP buckets, undoing stage 2). Autocast for ``bf16`` is still applied by
  ``accelerator.prepare_model(..., evaluation_mode=True)``, which never wraps.
* **Gradient accumulation.** Trainer runs non-final micro-batches under ``accelerator.no_sync(model)``,
  which calls ``ShardedModule.no_sync``: :meth:`ShardedOptimizer.accumulating`. Stage 1 communicates once per
  optimizer step; stage 2 reduces each micro-batch (that is what frees the full gradient); with offload the
  sums stay on the device until the final micro-batch. Trainer's ``model.zero_grad()`` after each step
  reaches :meth:`ShardedOptimizer.zero_grad`, which clears the gradient shards too.
* **fp16** (``fp16=True``: fp16 autocast over fp32 parameters). accelerate's ``torch.amp.GradScaler`` is replaced by
  :class:`OptimizerLossScaler`, which hands scaling, unscaling and the overflow check to ShardedOptimizer's
  own dynamic loss scaler (set up like the GradScaler it replaces). An overflowing step is skipped on every
  rank and reported to Trainer as skipped, so the LR schedule waits, exactly as with the GradScaler; the
  current scale is logged as ``loss_scale``.
* **Clipping and the logged grad norm** are the global norm of the averaged gradients
  (:meth:`ShardedOptimizer.clip_grad_norm_`), not the rank-local norm accelerate would compute.
* **Device placement.** The optimizer is prepared by accelerate without it: accelerate's default copies
  ``optimizer.state_dict()`` to the GPU and loads it back, which with offload would put the host master
  weights and optimizer state on the device at the start of ``train()``.
* **Checkpoints** are sharded: at ``save_steps`` every rank writes its own shard through
  :func:`zeroimpl.checkpoint.save_checkpoint` into ``<checkpoint>/zeroimpl`` (no gather on rank 0), and
  ``resume_from_checkpoint`` loads them with :func:`~zeroimpl.checkpoint.load_checkpoint`, on the same or
  another world size. Trainer never calls ``optimizer.state_dict()`` for the checkpoint.
* **DeepSpeed / FSDP settings** in ``TrainingArguments`` raise at construction: two sharding systems would
  both own the gradients.

Other ``Trainer`` subclasses (TRL's ``SFTTrainer`` / ``DPOTrainer``, a PEFT model's trainer, your own) get the same by
one class with ZeroTrainer first among its bases::

    class ZeroSFTTrainer(ZeroTrainer, SFTTrainer): pass

ZeroTrainer must come first: its ``__init__`` takes the ``zero_*`` keywords before the other trainer's ``__init__``
sees them, and its hooks (:data:`REPLACED_HOOKS`) are the ones Trainer calls. The other order is refused when the
class is defined (:func:`check_base_order`). An override of one of those hooks in the other trainer does not run;
defining the class warns, naming it (:func:`bypassed_overrides`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional, Union

import torch
import transformers

from zeroimpl import CPUOffload, LossScaleConfig, ShardedOptimizer
from zeroimpl.module_buffers import BufferBroadcast, no_sync
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint
from zeroimpl.integrations.muon import split_hidden_matrices

CHECKPOINT_SUBDIR = "zeroimpl"

# Trainer's hooks that ZeroTrainer replaces without calling the next class's: it owns the optimizer, the model's
# wrapping, clipping and the optimizer's part of a checkpoint.
REPLACED_HOOKS = ("create_optimizer", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
                  "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")


CONFLICT = ("ZeroTrainer shards the optimizer itself, so it cannot run with DeepSpeed or FSDP (both would own "
            "the gradients): remove deepspeed=... / fsdp=... from TrainingArguments (and from accelerate's config), "
            "or use the plain Trainer with them")


def check_training_arguments(args: transformers.TrainingArguments) -> None:
    """Refuse settings ZeroTrainer cannot honour, before Trainer builds anything."""
    if args.deepspeed or args.fsdp:
        raise ValueError(CONFLICT)


def training_arguments_among(args: tuple, kwargs: dict) -> Optional[transformers.TrainingArguments]:
    """The ``TrainingArguments`` a trainer's constructor was given, by keyword or at any position (TRL's
    ``DPOTrainer`` takes ``ref_model`` second and ``args`` third)."""
    return next((a for a in (kwargs.get("args"), *args) if isinstance(a, transformers.TrainingArguments)), None)


def check_base_order(cls: type) -> None:
    """Refuse a ZeroTrainer subclass in whose method resolution order another ``Trainer`` subclass stands before
    ZeroTrainer (``class X(SFTTrainer, ZeroTrainer)``), naming the order that works.

    Invariant kept for every class that passes: ZeroTrainer's methods come before those of every ``Trainer`` subclass
    that is not itself a ZeroTrainer, so ZeroTrainer's ``__init__`` takes the ``zero_*`` keywords before another
    trainer's ``__init__`` sees them (which would raise ``TypeError: unexpected keyword argument 'zero_stage'``),
    and Trainer calls ZeroTrainer's hooks, not another trainer's (which would build a plain optimizer and wrap the
    model in DDP)."""
    mro = cls.__mro__
    before = [c for c in mro[:mro.index(ZeroTrainer)]
              if issubclass(c, transformers.Trainer) and not issubclass(c, ZeroTrainer)]
    if before:
        fixed = sorted(cls.__bases__, key=lambda base: not issubclass(base, ZeroTrainer))  # stable: the rest keep order
        raise TypeError(
            f"class {cls.__name__}({_names(cls.__bases__)}) puts {before[0].__name__} before ZeroTrainer, so "
            f"{before[0].__name__}'s __init__ would be handed ZeroTrainer's zero_* keywords (TypeError: unexpected "
            f"keyword argument 'zero_stage') and any Trainer hook it overrides would replace ZeroTrainer's (a plain "
            f"optimizer, the model wrapped in DDP). Put ZeroTrainer first: class {cls.__name__}({_names(fixed)})")


def bypassed_overrides(cls: type) -> list[str]:
    """``Class.hook`` for each of :data:`REPLACED_HOOKS` that a ``Trainer`` subclass after ZeroTrainer in ``cls``'s
    method resolution order overrides and no class before ZeroTrainer overrides again: what those overrides add
    (TRL's GRPOTrainer restores its entropy controller in ``_load_optimizer_and_scheduler``) never runs."""
    mro = cls.__mro__
    position = mro.index(ZeroTrainer)
    redefined = {name for c in mro[:position] for name in vars(c)}
    return [f"{c.__name__}.{hook}" for c in mro[position + 1:]
            if issubclass(c, transformers.Trainer) and c is not transformers.Trainer
            for hook in REPLACED_HOOKS if hook in vars(c) and hook not in redefined]


def _names(classes) -> str:
    return ", ".join(c.__name__ for c in classes)


class OptimizerLossScaler:
    """What accelerate and Trainer ask of ``torch.amp.GradScaler``, done by ShardedOptimizer's loss scaler.

    accelerate calls ``scale(loss)`` before backward and ``step(optimizer)`` then ``update()`` for each
    optimizer step; a step is "skipped" for Trainer (no LR-scheduler step) when the optimizer's own ``step``,
    which accelerate patches to notice the call, is not called. Trainer saves ``state_dict()`` in
    ``scaler.pt``; the same state is also in the sharded checkpoint.
    """

    def __init__(self, optimizer: ShardedOptimizer, replaced: torch.amp.GradScaler):
        self.optimizer = optimizer
        self.replaced = replaced  # accelerate's GradScaler: its settings for the next optimizer (model_init)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def unscale_(self, optimizer=None) -> None:
        self.optimizer.found_nonfinite()  # unscales the gradient shards, once per step

    def step(self, optimizer, *args, **kwargs):
        if self.optimizer.found_nonfinite():
            # the unpatched step: it skips (or raises at the minimum scale) and accelerate sees no step
            return type(self.optimizer).step(self.optimizer)
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None) -> None:
        if new_scale is not None:
            raise NotImplementedError("ZeroTrainer's loss scale is dynamic; it cannot be set by hand")

    def get_scale(self) -> float:
        return self.optimizer.loss_scale

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict:
        return self.optimizer.loss_scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.loss_scaler.load_state_dict(state)


def loss_scale_like(scaler: torch.amp.GradScaler) -> LossScaleConfig:
    """The dynamic loss scaling of a torch GradScaler (which has no hysteresis) in zeroimpl's terms. One
    difference is kept on purpose: the scale stops at ``min_scale`` 1, where an overflow means broken
    gradients and ShardedOptimizer's ``nonfinite`` policy applies (a GradScaler would keep halving)."""
    return LossScaleConfig(initial_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                           backoff_factor=scaler.get_backoff_factor(),
                           growth_interval=scaler.get_growth_interval(), hysteresis=1)


class ShardedModule(torch.nn.Module):
    """The model as Trainer trains it: ``no_sync`` and ``zero_grad`` routed to the optimizer, and rank 0's buffers
    broadcast before a forward exactly when DDP with ``broadcast_buffers=True`` broadcasts them
    (:class:`zeroimpl.module_buffers.BufferBroadcast`).

    Trainer recognises it as already wrapped, so accelerate never wraps it in DistributedDataParallel.
    """

    def __init__(self, module: torch.nn.Module, broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.buffer_broadcast = BufferBroadcast(module) if broadcast_buffers else None
        self.optimizer: Optional[ShardedOptimizer] = None  # set once the trainer builds it

    def forward(self, *args, **kwargs):
        with self.buffer_broadcast.forward() if self.buffer_broadcast is not None else contextlib.nullcontext():
            return self.module(*args, **kwargs)

    def no_sync(self):
        """Non-final micro-batches of gradient accumulation (accelerate's ``no_sync`` calls this)."""
        return no_sync([self.optimizer] if self.optimizer is not None else [], self.buffer_broadcast)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
        else:
            self.module.zero_grad(set_to_none)


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` with a :class:`zeroimpl.ShardedOptimizer` of ``TrainingArguments.optim``'s class over
    Trainer's param groups, and sharded checkpoints. DeepSpeed or FSDP settings raise ``ValueError``.

    Args (besides Trainer's own):
        zero_stage: 1 (shard optimizer state) or 2 (also gradients).
        zero_offload: ``None``, ``"cpu"`` or :class:`zeroimpl.CPUOffload`.
        zero_options: other ShardedOptimizer keywords.
        zero_muon: ``torch.optim.Muon``'s hyperparameters (``{}``: its defaults) for the linear layers' 2-D weights
            but the output head; ``None``: no Muon.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_base_order(cls)
        bypassed = bypassed_overrides(cls)
        if bypassed:
            warnings.warn(f"{cls.__name__}: ZeroTrainer replaces {', '.join(bypassed)} (it owns the optimizer, the "
                          "model's wrapping, clipping and the optimizer's checkpoint), so these overrides do not run; if "
                          f"what they add matters, override the hook in {cls.__name__}, call super() (ZeroTrainer's) "
                          "and add it there", stacklevel=2)

    def __init__(self, *args, zero_stage: int = 2, zero_offload: Union[None, str, CPUOffload] = None,
                 zero_options: Optional[dict] = None, zero_muon: Optional[dict] = None, **kwargs):
        training_args = training_arguments_among(args, kwargs)
        if training_args is not None:
            check_training_arguments(training_args)
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # enabled through accelerate's own config
            raise ValueError(CONFLICT)
        check_training_arguments(self.args)
        self.zero_stage = zero_stage
        self.zero_offload = zero_offload
        self.zero_options = dict(zero_options or {})
        self.zero_muon = None if zero_muon is None else dict(zero_muon)
        self.sharded_optimizer: Optional[ShardedOptimizer] = None

    # -- optimizer -----------------------------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        model = model.module if isinstance(model, ShardedModule) else model
        optimizer_class, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        if self.zero_muon is not None:
            matrices, groups = split_hidden_matrices(model, groups)
            groups = [{"params": matrices, "optimizer": torch.optim.Muon, **self.zero_muon}] + groups
        groups = [g for g in groups if g["params"]]
        options = dict(self.zero_options)
        amp_scaler = self.accelerator.scaler  # set by accelerate for fp16 mixed precision only
        if isinstance(amp_scaler, OptimizerLossScaler):  # a new optimizer (train() with model_init rebuilds it)
            amp_scaler = amp_scaler.replaced
        if amp_scaler is not None:
            options.setdefault("loss_scale", loss_scale_like(amp_scaler))
        self.sharded_optimizer = ShardedOptimizer(groups, optimizer_class, stage=self.zero_stage,
                                                  offload=self.zero_offload, **options, **optimizer_kwargs)
        if amp_scaler is not None and self.sharded_optimizer.loss_scaler is not None:
            # before accelerate prepares the optimizer, which keeps the scaler
            self.accelerator.scaler = OptimizerLossScaler(self.sharded_optimizer, amp_scaler)
        if isinstance(self.model_wrapped, ShardedModule):
            self.model_wrapped.optimizer = self.sharded_optimizer
        # prepared here, without device placement, so that Trainer's own prepare leaves it be: accelerate would
        # move state_dict() to the device and load it back (offload's host masters and state onto the GPU)
        self.optimizer = self.accelerator.prepare(self.sharded_optimizer, device_placement=[False])
        return self.optimizer

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if isinstance(model, ShardedModule) or not training:
            return model
        self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)  # autocast only
        # Trainer passes ddp_broadcast_buffers to DDP only when set; DDP's default is True
        wrapped = ShardedModule(model, broadcast_buffers=self.args.ddp_broadcast_buffers is not False)
        wrapped.optimizer = self.sharded_optimizer
        return wrapped

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(model, ShardedModule) and model.optimizer is None:
            model.optimizer = self.sharded_optimizer
        return super().training_step(model, inputs, num_items_in_batch)

    # -- clipping and the logged norm ---------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        return self.sharded_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping: the global 2-norm, leaving the gradients as they are
            grad_norm = self.sharded_optimizer.clip_grad_norm_(float("inf"))
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self.sharded_optimizer is not None and self.sharded_optimizer.loss_scale is not None:
            logs["loss_scale"] = self.sharded_optimizer.loss_scale
        super().log(logs, *args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_model(self, *args, **kwargs):
        if self.sharded_optimizer is not None:  # the model's weights, not parameter all-gathers in flight
            self.sharded_optimizer.finish_param_gathers()
        return super().save_model(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), self.sharded_optimizer, self.model)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        load_checkpoint(os.path.join(checkpoint, CHECKPOINT_SUBDIR), self.sharded_optimizer, self.model,
                        missing=f"{checkpoint} has no {CHECKPOINT_SUBDIR}/ folder: it was not saved by ZeroTrainer, "
                        "so its optimizer state cannot be resumed here")
        scheduler = torch.load(os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)
