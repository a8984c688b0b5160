"""Hugging Face Trainer with zeroimpl: ZeRO stage 1/2 and CPU offload by changing two lines of a script.

    from integrations.trainer import ZeroTrainer
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
* **Clipping and the logged grad norm** are the global norm of the averaged gradients
  (:meth:`ShardedOptimizer.clip_grad_norm_`), not the rank-local norm accelerate would compute.
* **Checkpoints** are sharded: at ``save_steps`` every rank writes its own shard through
  :func:`zeroimpl.checkpoint.save_checkpoint` into ``<checkpoint>/zeroimpl`` (no gather on rank 0), and
  ``resume_from_checkpoint`` loads them with :func:`~zeroimpl.checkpoint.load_checkpoint`, on the same or
  another world size. Trainer never calls ``optimizer.state_dict()`` for the checkpoint.
* **DeepSpeed / FSDP settings** in ``TrainingArguments`` raise at construction: two sharding systems would
  both own the gradients.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Union

import torch
import transformers

from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

CHECKPOINT_SUBDIR = "zeroimpl"


CONFLICT = ("ZeroTrainer shards the optimizer itself, so it cannot run with DeepSpeed or FSDP (both would own "
            "the gradients): remove deepspeed=... / fsdp=... from TrainingArguments (and from accelerate's config), "
            "or use the plain Trainer with them")


def check_training_arguments(args: transformers.TrainingArguments) -> None:
    """Refuse settings ZeroTrainer cannot honour, before Trainer builds anything."""
    if args.deepspeed or args.fsdp:
        raise ValueError(CONFLICT)
    if args.fp16:
        raise ValueError("ZeroTrainer does not support fp16 mixed precision yet (accelerate's GradScaler looks for "
                         "full gradients, which ZeRO keeps in shards): use bf16=True, or fp32")


class ShardedModule(torch.nn.Module):
    """The model as Trainer trains it: forward unchanged, ``no_sync`` and ``zero_grad`` routed to the optimizer.

    Trainer recognises it as already wrapped, so accelerate never wraps it in DistributedDataParallel.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.optimizer: Optional[ShardedOptimizer] = None  # set once the trainer builds it

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Non-final micro-batches of gradient accumulation (accelerate's ``no_sync`` calls this)."""
        return self.optimizer.accumulating() if self.optimizer is not None else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
        else:
            self.module.zero_grad(set_to_none)


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer is a :class:`zeroimpl.ShardedOptimizer`.

    Args (besides Trainer's own):
        zero_stage: 1 (shard optimizer state) or 2 (also shard gradients).
        zero_offload: ``None``, ``"cpu"`` or :class:`zeroimpl.CPUOffload`.
        zero_options: other ``ShardedOptimizer`` keywords (``bucket_numel``, ``reduce_dtype``, ...).

    The inner optimizer is the one ``TrainingArguments.optim`` selects (AdamW by default), with Trainer's
    decay / no-decay param groups and hyperparameters.
    """

    def __init__(self, *args, zero_stage: int = 2, zero_offload: Union[None, str, CPUOffload] = None,
                 zero_options: Optional[dict] = None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            check_training_arguments(training_args)
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # enabled through accelerate's own config
            raise ValueError(CONFLICT)
        check_training_arguments(self.args)
        self.zero_stage = zero_stage
        self.zero_offload = zero_offload
        self.zero_options = dict(zero_options or {})
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
        groups = [g for g in groups if g["params"]]
        self.sharded_optimizer = ShardedOptimizer(groups, optimizer_class, stage=self.zero_stage,
                                                  offload=self.zero_offload, **self.zero_options,
                                                  **optimizer_kwargs)
        if isinstance(self.model_wrapped, ShardedModule):
            self.model_wrapped.optimizer = self.sharded_optimizer
        self.optimizer = self.sharded_optimizer
        return self.optimizer

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if isinstance(model, ShardedModule) or not training:
            return model
        self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)  # autocast only
        wrapped = ShardedModule(model)
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

    # -- checkpoints ----------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), self.sharded_optimizer, self.model)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        directory = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{checkpoint} has no {CHECKPOINT_SUBDIR}/ folder: it was not saved by "
                                    "ZeroTrainer, so its optimizer state cannot be resumed here")
        load_checkpoint(directory, self.sharded_optimizer, self.model)
        scheduler = torch.load(os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)
