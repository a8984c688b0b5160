"""PyTorch Lightning strategies for ``Trainer`` and ``Fabric``: ZeRO-1/2 and CPU offload.

    import zeroimpl.integrations.lightning                          # registers the names below
    trainer = lightning.Trainer(strategy="zero2", devices=2)        # or "zero1", "zero2_offload", ZeroStrategy(...)
    fabric = lightning.Fabric(strategy="zero2", devices=2)          # or FabricZeroStrategy(...)

The LightningModule (``configure_optimizers``) and the Fabric loop (``fabric.setup(model, optimizer)``) stay as they
are: any torch optimizer is rebuilt as a :class:`~zeroimpl.ShardedOptimizer` of the same class, param groups and
hyperparameters (a ``ShardedOptimizer`` is taken as is), and the LR schedulers are re-pointed at it.

Both strategies are Lightning's ``DDPStrategy`` (launch, process group, distributed sampler, metric reduction)
with every place that assumes a ``DistributedDataParallel`` wrapper replaced:

* **No DDP.** The model is never wrapped (ShardedOptimizer reduces the gradients itself; under DDP it could only
  run stage 1, on DDP's all-reduced gradients).
  Rank 0's parameters and buffers are broadcast once at setup, as DDP's constructor does.
* **Buffers** (BatchNorm's statistics): rank 0's are broadcast before a forward exactly when DDP with
  ``broadcast_buffers=True`` would (:class:`zeroimpl.module_buffers.BufferBroadcast`), so every rank holds DDP's
  buffers.
* **Accumulation**: Trainer's ``block_backward_sync`` (``accumulate_grad_batches``) and Fabric's
  ``no_backward_sync`` become :meth:`ShardedOptimizer.accumulating`.
* **Clipping by norm** is :meth:`ShardedOptimizer.clip_grad_norm_`, the global norm over every rank's shard
  (Trainer: the precision plugin's ``clip_grad_by_norm``; Fabric: ``clip_gradients_norm``). By value, torch's
  ``clip_grad_value_`` acts on the sharded ``param.grad`` views elementwise, as under DDP.
* **fp16 mixed precision** runs through Lightning's own ``MixedPrecision`` plugin and its ``torch.amp.GradScaler``,
  which unscales and checks the sharded ``param.grad`` views (the inf check is agreed across ranks). Lightning
  turns ``precision="16-mixed"`` on CPU into ``"bf16-mixed"``; pass ``plugins=MixedPrecision("16-mixed", "cpu")``
  for fp16 there. Parameters in fp16 (``"16-true"``) would need ShardedOptimizer's own loss scaling, which
  Lightning does not call: refused at setup.
* **Checkpoints** keep every rank's shard. Lightning writes rank 0's ``optimizer.state_dict()`` alone; here the
  checkpoint path is a directory, as Lightning's DeepSpeed and FSDP strategies make it: every rank writes its own
  shard with :func:`zeroimpl.checkpoint.save_checkpoint` into ``<checkpoint>/optimizer-<i>/``, and rank 0 the
  Lightning file ``<checkpoint>/lightning.ckpt`` with everything else (weights, loops, schedulers, callbacks, the
  GradScaler) and a placeholder for the optimizer. Resuming loads the shards with
  :func:`~zeroimpl.checkpoint.load_checkpoint`, on any number of devices; a checkpoint without its shards raises,
  it never starts the optimizer afresh. Lightning removes and links the directory as it does a file.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref
from datetime import timedelta
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
# (private: the only seam Fabric gives for no_backward_sync)
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim.optimizer import Optimizer

from zeroimpl import CPUOffload, ShardedOptimizer, sync_module_states
from zeroimpl.module_buffers import BufferBroadcast, no_sync
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

LIGHTNING_FILE = "lightning.ckpt"  # in a checkpoint directory: what Lightning itself saves (rank 0)
CHECKPOINT_KEY = "zeroimpl"  # in the Lightning file: which optimizers' shards the directory holds
# name -> ShardedOptimizer options, registered for Trainer and Fabric alike
REGISTERED = {"zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero2_offload": {"stage": 2, "offload": "cpu"}}
# ShardedOptimizer's own keywords: everything else it takes goes to the inner optimizer class
SHARDED_OPTIONS = frozenset(name for name, parameter in inspect.signature(ShardedOptimizer).parameters.items()
                            if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name != "params"
                            and name != "optimizer_class")


# -- the optimizer ----------------------------------------------------------------------------------
def check_options(options: dict, strategy: str) -> dict:
    """Refuse a keyword ShardedOptimizer does not take, before it would reach the inner optimizer class."""
    unknown = sorted(set(options) - SHARDED_OPTIONS)
    if unknown:
        raise TypeError(f"{strategy} got {unknown}, which ShardedOptimizer does not take; its options are "
                        f"{sorted(SHARDED_OPTIONS)} (the optimizer's hyperparameters belong in configure_optimizers)")
    return options


def sharded_like(optimizer: Optimizer, options: dict) -> ShardedOptimizer:
    """``optimizer`` as a ShardedOptimizer: the same class, param groups (every key, ``initial_lr`` of a scheduler
    included) and defaults; a ShardedOptimizer is returned as it is. ``options``: ShardedOptimizer's keywords."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    return ShardedOptimizer.from_optimizer(optimizer, **options)  # refuses one that holds state


def check_loss_scaling(optimizer: ShardedOptimizer) -> None:
    """Refuse an optimizer whose own loss scaling is on (fp16 parameters, or ``loss_scale=`` given): Lightning
    would never scale the loss through it."""
    if optimizer.loss_scale is not None:
        raise ValueError("this ShardedOptimizer scales the loss itself (its parameters are fp16, as with "
                         "precision='16-true', or it was built with loss_scale=...), through optimizer.backward, "
                         "which Lightning never calls: train with precision='16-mixed' (fp32 parameters and "
                         "Lightning's GradScaler) or 'bf16-true', or build it with loss_scale=None")


def repoint_schedulers(schedulers: Iterable[Any], replaced: dict[int, ShardedOptimizer]) -> None:
    """Point each LR scheduler built over a replaced optimizer (``id(old) -> new``) at its ShardedOptimizer, whose
    param groups carry the same ``lr`` and ``initial_lr``."""
    for scheduler in schedulers:
        new = replaced.get(id(getattr(scheduler, "optimizer", None)))
        if new is None:
            continue
        scheduler.optimizer = new
        track_step_calls(new)


def track_step_calls(optimizer: Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built over (a private protocol of
    ``torch.optim.lr_scheduler``: ``step._wrapped_by_lr_sched`` and ``_opt_called``): mark each ``step()`` call, so
    that the scheduler's check that ``optimizer.step()`` ran first holds and does not warn that step was replaced."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step, reference = type(optimizer).step, weakref.ref(optimizer)  # no cycle: dropping it waits for its gathers

    @functools.wraps(step)
    def marked(*args, **kwargs):
        owner = reference()
        owner._opt_called = True
        return step(owner, *args, **kwargs)

    marked._wrapped_by_lr_sched = True
    optimizer.step = marked


# -- checkpoints ------------------------------------------------------------------------------------
def lightning_file(checkpoint_path: Union[str, os.PathLike]) -> str:
    """The Lightning file to read for ``checkpoint_path``: the one inside a zeroimpl checkpoint directory, else the
    path itself (a file saved by another strategy)."""
    path = os.fspath(checkpoint_path)
    return os.path.join(path, LIGHTNING_FILE) if os.path.isdir(path) else path


def save_shards(directory, optimizers: dict[str, ShardedOptimizer], modules: list[torch.nn.Module]) -> dict:
    """Every rank writes its shard of each optimizer to ``<directory>/<name>/``. Collective. Returns what the
    Lightning file records under :data:`CHECKPOINT_KEY`."""
    for name, optimizer in optimizers.items():
        save_checkpoint(os.path.join(os.fspath(directory), name), optimizer, model_of(optimizer, modules))
    return {"optimizers": sorted(optimizers), "world_size": dist.get_world_size()}


def load_shards(checkpoint_path, record: Optional[dict], optimizers: dict[str, ShardedOptimizer],
                modules: list[torch.nn.Module]) -> None:
    """Restore each optimizer from its folder in the checkpoint directory ``checkpoint_path``, whose Lightning file
    holds ``record``. Collective. Raises on every rank, naming the checkpoint, when it holds no shards or a folder
    is missing."""
    if record is None:
        raise RuntimeError(f"{checkpoint_path} holds no zeroimpl optimizer shards (it was saved by another "
                           "strategy, or with save_weights_only), so the optimizer state cannot be resumed: resume "
                           "from a checkpoint saved with the zeroimpl strategy, or load only the weights "
                           f"(LightningModule.load_from_checkpoint of its {LIGHTNING_FILE}) and start the optimizer "
                           "afresh")
    for name, optimizer in optimizers.items():
        folder = os.path.join(os.fspath(checkpoint_path), name)
        missing = (f"{checkpoint_path}: the optimizer shards of {name!r} should be in {folder}, which is missing; "
                   "copy the whole checkpoint directory")
        if name not in record["optimizers"]:
            raise FileNotFoundError(missing)
        load_checkpoint(folder, optimizer, model_of(optimizer, modules), missing=missing)


def model_of(optimizer: ShardedOptimizer, modules: list[torch.nn.Module]) -> torch.nn.Module:
    """The set-up module whose parameters ``optimizer`` trains (the checkpoint names parameters by it)."""
    for module in modules:
        if optimizer.trains(module):
            return module
    raise RuntimeError("the optimizer trains no parameter of a module set up with this strategy; set the model up "
                       "with the strategy before saving or loading its optimizer")


# -- what both strategies share --------------------------------------------------------------------
class ShardedStrategy:
    """What the Trainer and Fabric strategies share, mixed in before Lightning's ``DDPStrategy`` of each. Each
    strategy holds its ShardedOptimizers as ``sharded_optimizers``."""

    sharded_optimizers: list[ShardedOptimizer]

    def _take_options(self, stage: int, offload: Union[None, str, CPUOffload], broadcast_buffers: bool,
                     options: dict) -> None:
        """The strategy's own arguments (refusing a keyword ShardedOptimizer does not take)."""
        self.zero_options = check_options({"stage": stage, "offload": offload, **options}, type(self).__name__)
        self.broadcast_buffers = broadcast_buffers

    def _shard_optimizers(self, optimizers: list[Optimizer], schedulers: Iterable[Any]) -> list[ShardedOptimizer]:
        sharded = [sharded_like(optimizer, self.zero_options) for optimizer in optimizers]
        for optimizer in sharded:
            check_loss_scaling(optimizer)
        repoint_schedulers(schedulers, {id(old): new for old, new in zip(optimizers, sharded)})
        return sharded

    def optimizers_of(self, module: Optional[torch.nn.Module] = None) -> list[ShardedOptimizer]:
        """The ShardedOptimizers that train ``module``'s parameters (``None``: all of them)."""
        return [o for o in self.sharded_optimizers if module is None or o.trains(module)]

    def finish_param_gathers(self, module: Optional[torch.nn.Module] = None) -> None:
        """Finish the parameter all-gathers in flight (of ``module``'s optimizers; ``None``: all) before the weights
        are read."""
        for optimizer in self.optimizers_of(module):
            optimizer.finish_param_gathers()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        # Lightning's and Fabric's registration hook: the names of REGISTERED (DDPStrategy's own, which the class
        # would inherit, would name it "ddp")
        for name, options in REGISTERED.items():
            strategy_registry.register(name, cls, description=f"zeroimpl ShardedOptimizer, {options}",
                                       override=True, **options)


# -- Trainer ----------------------------------------------------------------------------------------
class ShardedClipping:
    """Mixed into the Trainer's precision plugin: clipping by norm is the optimizer's global
    :meth:`ShardedOptimizer.clip_grad_norm_` (Lightning's default computes it from ``param.grad``)."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, ShardedOptimizer):
            return super().clip_grad_by_norm(optimizer, clip_val)
        optimizer.clip_grad_norm_(clip_val)


@functools.lru_cache(maxsize=None)
def with_sharded_clipping(plugin_class: type) -> type:
    return type(f"Sharded{plugin_class.__name__}", (ShardedClipping, plugin_class), {})


def sharded_precision(plugin: Precision) -> Precision:
    """A copy of ``plugin`` (the same state: its GradScaler too) whose class also derives from
    :class:`ShardedClipping`, so that Lightning's checks of the plugin's class still hold."""
    if isinstance(plugin, ShardedClipping):
        return plugin
    copy = object.__new__(with_sharded_clipping(type(plugin)))
    copy.__dict__.update(plugin.__dict__)
    return copy


class ZeroStrategy(ShardedStrategy, DDPStrategy):
    """``lightning.pytorch.Trainer`` strategy: ``DDPStrategy`` with a :class:`~zeroimpl.ShardedOptimizer` in place
    of DDP. Registered as ``"zero1"``, ``"zero2"`` and ``"zero2_offload"``.

    Args:
        stage: 1 (shard optimizer state) or 2 (also gradients).
        offload: ``None``, ``"cpu"`` or :class:`zeroimpl.CPUOffload`.
        broadcast_buffers: broadcast rank 0's buffers as DDP does.
        accelerator: as ``DDPStrategy``.
        parallel_devices: as ``DDPStrategy``.
        cluster_environment: as ``DDPStrategy``.
        checkpoint_io: as ``DDPStrategy``.
        precision_plugin: as ``DDPStrategy``.
        process_group_backend: as ``DDPStrategy``.
        timeout: as ``DDPStrategy``.
        start_method: as ``DDPStrategy``.
        **options: other ShardedOptimizer keywords; any other, DDP's too, raises ``TypeError``.
    """

    def __init__(self, stage: int = 2, offload: Union[None, str, CPUOffload] = None, broadcast_buffers: bool = True,
                 accelerator=None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen", **options: Any):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._take_options(stage, offload, broadcast_buffers, options)
        self.buffers: Optional[BufferBroadcast] = None

    @property
    def precision_plugin(self) -> Precision:
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        DDPStrategy.precision_plugin.fset(self, sharded_precision(plugin if plugin is not None else Precision()))

    @property
    def sharded_optimizers(self) -> list[ShardedOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, ShardedOptimizer)]

    @property
    def _named_optimizers(self) -> dict[str, ShardedOptimizer]:
        """Each ShardedOptimizer by the name of its folder in a checkpoint directory: ``optimizer-<i>``."""
        return {f"optimizer-{index}": opt for index, opt in enumerate(self.sharded_optimizers)}

    # -- setup: DDPStrategy.setup without the DDP wrapper and without moving optimizer state to the device
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:  # (DDPStrategy's private attribute: sync_batchnorm=True)
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sync_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self.buffers = BufferBroadcast(self.model) if self.broadcast_buffers else None
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, parsed by Lightning
        self.optimizers = self._shard_optimizers(self.optimizers,
                                                [config.scheduler for config in self.lr_scheduler_configs])

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Non-final micro-batches (``accumulate_grad_batches``, ``toggle_model(sync_grad=False)``)."""
        with no_sync(self.sharded_optimizers, self.buffers):
            yield

    def training_step(self, *args: Any, **kwargs: Any):
        if self.buffers is None:
            return super().training_step(*args, **kwargs)
        # in manual optimization DDPStrategy runs the training step (manual_backward included) inside DDP's forward
        # and turns DDP's gradient sync off before the forward ends (its _DDPForwardRedirection), so no forward arms
        # the next broadcast: DDP broadcasts before the first one only, as inside no_sync
        manual = not self.lightning_module.automatic_optimization
        with self.buffers.no_sync() if manual else contextlib.nullcontext(), self.buffers.forward():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        # while fitting, DDPStrategy runs validation through DDP's forward, which broadcasts by the same rule
        with self.buffers.forward() if self.buffers is not None else contextlib.nullcontext():
            return super().validation_step(*args, **kwargs)

    # -- checkpoints ------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.finish_param_gathers()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """A placeholder: :meth:`save_checkpoint` writes the state per rank."""
        return {CHECKPOINT_KEY: "sharded: every rank's part is in its folder of this checkpoint directory"}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Collective: ``filepath`` becomes a directory of every rank's shards (``optimizer-<i>/``) and rank 0's
        ``lightning.ckpt``."""
        if "optimizer_states" in checkpoint and self.optimizers:  # not save_weights_only
            checkpoint[CHECKPOINT_KEY] = save_shards(filepath, self._named_optimizers, [self.lightning_module])
        super().save_checkpoint(checkpoint, os.path.join(os.fspath(filepath), LIGHTNING_FILE), storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return super().load_checkpoint(lightning_file(checkpoint_path), weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        load_shards(self.lightning_module.trainer.ckpt_path, checkpoint.get(CHECKPOINT_KEY), self._named_optimizers,
                    [self.lightning_module])

    def teardown(self) -> None:
        self.buffers = None
        super().teardown()


# -- Fabric -----------------------------------------------------------------------------------------
class ShardedBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the model's optimizers accumulate, and its buffers follow DDP's rule."""

    def __init__(self, strategy: "FabricZeroStrategy"):
        self.strategy = strategy

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        return no_sync(self.strategy.optimizers_of(module), self.strategy.buffers.get(id(module)))


class FabricZeroStrategy(ShardedStrategy, FabricDDPStrategy):
    """``lightning.fabric.Fabric`` strategy: ``fabric.setup`` (and ``setup_optimizers``) returns the model unwrapped
    and each optimizer as a :class:`~zeroimpl.ShardedOptimizer`. Options: as :class:`ZeroStrategy`'s, ``precision``
    for ``precision_plugin``.
    """

    def __init__(self, stage: int = 2, offload: Union[None, str, CPUOffload] = None, broadcast_buffers: bool = True,
                 accelerator=None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen", **options: Any):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._take_options(stage, offload, broadcast_buffers, options)
        self._backward_sync_control = ShardedBackwardSync(self)  # (private: what fabric.no_backward_sync calls)
        self.modules: list[torch.nn.Module] = []
        self.sharded_optimizers: list[ShardedOptimizer] = []
        self.buffers: dict[int, BufferBroadcast] = {}  # id(module) -> its rule, attached as hooks

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        module = self.setup_module(module)
        sharded = self._shard_optimizers(optimizers, [] if scheduler is None else [scheduler])
        self.sharded_optimizers += sharded
        return module, sharded, scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module, unwrapped, with rank 0's parameters and buffers and DDP's buffer broadcasts."""
        sync_module_states(module)
        if self.broadcast_buffers:
            self.buffers[id(module)] = BufferBroadcast(module).attach()
        self.modules.append(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        (sharded,) = self._shard_optimizers([optimizer], [])
        self.sharded_optimizers.append(sharded)
        return sharded

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite: bool = True):
        """The global norm over every shard; a NaN or Inf norm raises with ``error_if_nonfinite``, as torch's."""
        if not isinstance(optimizer, ShardedOptimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        norm = optimizer.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return norm

    def get_module_state_dict(self, module: torch.nn.Module) -> dict:
        self.finish_param_gathers(module)
        return super().get_module_state_dict(module)

    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None, filter=None) -> None:
        """Collective: ``path`` becomes a directory: each ShardedOptimizer in ``state`` per rank in ``<path>/<key>/``,
        the rest in rank 0's ``<path>/lightning.ckpt``."""
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, ShardedOptimizer)}
        if optimizers:
            state = {key: ({CHECKPOINT_KEY: "sharded: see its folder in this checkpoint directory"}
                           if key in optimizers else obj) for key, obj in state.items()}
            state[CHECKPOINT_KEY] = save_shards(path, optimizers, self.modules)
        super().save_checkpoint(os.path.join(os.fspath(path), LIGHTNING_FILE), state, storage_options=storage_options,
                                filter=filter)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        """As Fabric's, then each ShardedOptimizer in ``state`` restored from its shards."""
        if isinstance(state, ShardedOptimizer):
            raise TypeError("a sharded optimizer cannot load from one state file: load it with its model, "
                            "fabric.load(path, {'model': model, 'optimizer': optimizer})")
        file = lightning_file(path)
        if not isinstance(state, dict):
            return super().load_checkpoint(file, state, strict=strict, weights_only=weights_only)
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, ShardedOptimizer)}
        rest = {key: obj for key, obj in state.items() if key not in optimizers}
        if not rest:  # Fabric's own load would hand back the whole checkpoint and restore nothing
            checkpoint = super().load_checkpoint(file, None, strict=strict, weights_only=weights_only)
        else:
            checkpoint = super().load_checkpoint(file, rest, strict=strict, weights_only=weights_only)
            state.update(rest)  # the plain values Fabric's load set in ``rest``
        if optimizers:
            load_shards(path, checkpoint.pop(CHECKPOINT_KEY, None), optimizers, self.modules)
            for key in optimizers:
                checkpoint.pop(key, None)
        return checkpoint

    def teardown(self) -> None:
        for buffers in self.buffers.values():
            buffers.remove()
        self.buffers = {}
        super().teardown()


# Lightning registers its own strategies through their register_strategies, called once per class in its
# strategies package; this module's classes are outside it, so importing the module calls theirs
ZeroStrategy.register_strategies(StrategyRegistry)
FabricZeroStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = ["ZeroStrategy", "FabricZeroStrategy", "sharded_like", "lightning_file", "REGISTERED"]
