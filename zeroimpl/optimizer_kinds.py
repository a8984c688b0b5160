"""Which torch optimizer classes ShardedOptimizer shards, and how.

* **flat** -- elementwise optimizers (AdamW, SGD, ...): each bucket is cut into equal chunks, across parameters.
* **whole** -- optimizers that need a whole parameter (Muon, Adafactor, any class in ``per_parameter``): one rank steps
  each parameter, as the plain optimizer would.
* **blocked** -- bitsandbytes' and torchao's low-bit optimizers, whose state is quantized in blocks from a parameter's
  first element (:func:`blocks_of`): shards are cut on block boundaries; quantization maps replicate.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Collection, Literal, Optional

import torch

from .layout import Blocks

Sharding = Literal["flat", "whole", "blocked"]

ELEMENTWISE_OPTIMIZERS = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop,
    torch.optim.Adadelta,
})
# (torch.optim.Adafactor since torch 2.5, torch.optim.Muon since 2.9)
WHOLE_PARAMETER_OPTIMIZERS = frozenset(cls for cls in (getattr(torch.optim, "Muon", None),
                                                       getattr(torch.optim, "Adafactor", None)) if cls is not None)
# checked bitwise against DDP (tests/test_optimizer_kinds_third_party.py); matched by "module.qualname", never imported
THIRD_PARTY_SHARDING: dict[str, "Sharding"] = {
    "timm.optim.adan.Adan": "flat",
    "schedulefree.adamw_schedulefree.AdamWScheduleFree": "flat",
    "schedulefree.sgd_schedulefree.SGDScheduleFree": "flat",
    "schedulefree.radam_schedulefree.RAdamScheduleFree": "flat",
    "timm.optim.lamb.Lamb": "whole",  # a trust ratio per parameter
}
# param-group keys that are not hyperparameters: never passed to an inner optimizer, never saved with them
OUTER_ONLY_KEYS = frozenset({"params", "param_names", "optimizer"})
BLOCKWISE_PACKAGES = ("bitsandbytes.", "torchao.")  # quantize state blockwise; matched by module, never imported
BITSANDBYTES_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantize in blocks of 256 (fixed in its kernels)
TORCHAO_THRESHOLD = 4096  # torchao quantizes a tensor of at least 4096 elements that whole blocks divide
REFUSED_OPTIMIZERS = {
    torch.optim.LBFGS: "its step re-evaluates a closure over the whole model and keeps a history of flattened "
                       "whole-model vectors, so no rank can step a shard of it",
    torch.optim.SparseAdam: "it needs sparse gradients, which a reduce-scatter of dense buckets cannot give",
}


def check_class(optimizer_class) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"an optimizer class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
                        f"got {optimizer_class!r}")


def sharding_of(optimizer_class: type, per_parameter: Collection[type], assume_elementwise: bool) -> Sharding:
    """How ``optimizer_class``'s groups are sharded; ValueError, naming the fix, for one that cannot be.
    ``per_parameter``: classes marked whole; ``assume_elementwise``: shard unknown classes flat."""
    check_class(optimizer_class)
    if optimizer_class in REFUSED_OPTIMIZERS:
        raise ValueError(f"{optimizer_class.__name__} cannot be sharded: {REFUSED_OPTIMIZERS[optimizer_class]}; "
                         "use an optimizer that steps each parameter on its own (AdamW, SGD, Muon, Adafactor, ...)")
    if optimizer_class in per_parameter or optimizer_class in WHOLE_PARAMETER_OPTIMIZERS:
        return "whole"
    if is_blockwise(optimizer_class) and _clips_by_update_norm(optimizer_class):
        return "whole"  # bitsandbytes' LAMB and LARS: the trust ratio needs the whole parameter's norms
    if is_blockwise(optimizer_class):
        if assume_elementwise:
            raise ValueError(f"{optimizer_class.__name__} quantizes its state in blocks counted from each parameter's "
                             "first element, so arbitrary flat shards would cut blocks and train differently from the "
                             "unsharded optimizer: leave assume_elementwise off (zeroimpl cuts its shards on block "
                             "boundaries, exactly)")
        return "blocked"
    known = THIRD_PARTY_SHARDING.get(f"{optimizer_class.__module__}.{optimizer_class.__qualname__}")
    if known is not None:  # even under assume_elementwise, which is for the classes zeroimpl does not know
        return known
    if optimizer_class in ELEMENTWISE_OPTIMIZERS or assume_elementwise:
        return "flat"
    raise ValueError(f"zeroimpl cannot tell how to shard {optimizer_class.__name__}. If it updates every element "
                     "from that element's own parameter, gradient and state only, pass assume_elementwise=True (flat "
                     "shards). Otherwise -- matrix or factored state (Shampoo, SOAP), state quantized in blocks, a "
                     "per-parameter norm or trust ratio (LAMB, LARS, max_unorm), or when unsure -- pass "
                     f"per_parameter=[{optimizer_class.__name__}]: each parameter is stepped whole by one rank, "
                     "exactly as the unsharded optimizer steps it (the safe choice)")


def _clips_by_update_norm(optimizer_class: type) -> bool:
    """Whether the class scales its update by a per-parameter norm ratio (bitsandbytes' ``max_unorm``)."""
    for cls in optimizer_class.__mro__[:-1]:  # (not object)
        try:
            setting = inspect.signature(cls.__init__).parameters.get("max_unorm")
        except ValueError:  # a constructor without a signature (an extension type's)
            continue
        if setting is not None and setting.default not in (0, 0.0, None, inspect.Parameter.empty):
            return True
    return False


def is_blockwise(optimizer_class: type) -> bool:
    return _comes_from(optimizer_class, BLOCKWISE_PACKAGES)


def _comes_from(optimizer_class: type, packages: tuple[str, ...]) -> bool:
    return any(cls.__module__.startswith(packages) for cls in optimizer_class.__mro__)


def blocks_of(group: dict) -> Blocks:
    """How a group's low-bit class quantizes state: bitsandbytes' in blocks of 256 from ``min_8bit_size`` elements on;
    torchao's in blocks of ``block_size`` for tensors of at least 4096 elements that the blocks divide."""
    optimizer_class = group["optimizer"]
    defaults = {name: p.default for name, p in inspect.signature(optimizer_class.__init__).parameters.items()}
    settings = {**defaults, **group}
    if _comes_from(optimizer_class, ("torchao.",)):
        if settings.get("block_size") is None:
            raise ValueError(f"{optimizer_class.__name__} has no block_size setting, so zeroimpl cannot tell how it "
                             "quantizes its state: use torchao's AdamW8bit, AdamW4bit or AdamWFp8")
        return Blocks(int(settings["block_size"]), TORCHAO_THRESHOLD, whole_blocks=True)
    return Blocks(BITSANDBYTES_BLOCK, int(settings.get("min_8bit_size", 4096)))


def step_work(optimizer_class: type) -> Callable[[tuple], int]:
    """The cost of stepping a parameter of a shape, balanced across ranks: ``m*n*min(m, n)`` for Muon, else numel."""
    if optimizer_class is getattr(torch.optim, "Muon", None):
        return lambda shape: math.prod(shape) * (min(shape[-2:]) if len(shape) >= 2 else 1)
    return lambda shape: math.prod(shape)


def plan(params, optimizer_class: type, optimizer_kwargs: dict, per_parameter: Collection[type],
         assume_elementwise: bool) -> tuple[list[dict], list[Optional[Callable[[tuple], int]]], list[Optional[Blocks]]]:
    """(groups with their classes, per group a whole one's :func:`step_work`, a blocked one's blocks)."""
    check_class(optimizer_class)
    if isinstance(per_parameter, type) or not all(isinstance(cls, type) for cls in per_parameter):
        raise TypeError(f"per_parameter must be a list of optimizer classes, e.g. per_parameter=[MyShampoo], "
                        f"got {per_parameter!r}")
    groups = groups_with_classes(params, optimizer_class, optimizer_kwargs)
    kinds = [sharding_of(group["optimizer"], per_parameter, assume_elementwise) for group in groups]
    works = [step_work(group["optimizer"]) if kind == "whole" else None for group, kind in zip(groups, kinds)]
    blocks = [blocks_of(group) if kind == "blocked" else None for group, kind in zip(groups, kinds)]
    return groups, works, blocks


def settings_of(optimizer: torch.optim.Optimizer) -> tuple[list[dict], type, dict]:
    """A torch optimizer's param groups (copies), class and constructor defaults; refused once it holds state."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"from_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise ValueError(f"this {type(optimizer).__name__} has stepped (it holds state), which a ShardedOptimizer "
                         "built from it would not keep: wrap it before its first step, or load its state after "
                         "wrapping with zeroimpl.checkpoint.load_torch_optimizer_state")
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold keys the constructor refuses
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return [dict(group) for group in optimizer.param_groups], type(optimizer), defaults


def hand_over(optimizer: torch.optim.Optimizer, replacement: torch.optim.Optimizer):
    """Return ``replacement``; ``optimizer`` shares its ``param_groups`` (for LR schedulers), its ``step()`` raises."""
    optimizer.param_groups = replacement.param_groups

    def spent(*args, **kwargs):
        raise RuntimeError(f"this {type(optimizer).__name__} was replaced by a ShardedOptimizer "
                           "(ShardedOptimizer.from_optimizer): call step() on that one")

    optimizer.step = spent
    return replacement


def groups_with_classes(params, optimizer_class: type, optimizer_kwargs: dict) -> list[dict]:
    """Param groups (copies), their class under ``"optimizer"``; ``optimizer_kwargs`` fill ``optimizer_class``'s."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters or of param-group dicts (e.g. "
                        f"model.parameters()), got a single tensor of shape {tuple(params.shape)}")
    params = list(params)
    groups = [dict(group) for group in params] if params and isinstance(params[0], dict) else [{"params": params}]
    for group in groups:
        group_class = group.setdefault("optimizer", optimizer_class)
        check_class(group_class)
        if group_class is optimizer_class:
            for key, value in optimizer_kwargs.items():
                group.setdefault(key, value)
        if group.get("args") is not None and _comes_from(group_class, ("bitsandbytes.",)):
            raise ValueError(f"{group_class.__name__}(args=...): bitsandbytes then ignores its keyword arguments "
                             "for the settings in args, which zeroimpl reads from the keyword arguments to cut its "
                             "shards (min_8bit_size) or step whole parameters (max_unorm): pass the settings as "
                             "keyword arguments instead")
    if optimizer_kwargs and all(group["optimizer"] is not optimizer_class for group in groups):
        raise ValueError(f"the keyword arguments {sorted(optimizer_kwargs)} are {optimizer_class.__name__}'s, but "
                         f"every param group names another optimizer class; put them in the groups they are for, "
                         "or pass the class most groups use as optimizer_class")
    return groups


def check_whole_groups(groups: list[dict]) -> None:
    """Build each group of torch's whole-parameter classes over meta copies of its parameters, so that every rank, not
    only the owner, refuses a bad group (Muon: a parameter not 2-D). A user's class may read values: not built."""
    for group in groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        if group["optimizer"] in WHOLE_PARAMETER_OPTIMIZERS and trainable:
            hyperparameters = {k: v for k, v in group.items() if k not in OUTER_ONLY_KEYS}
            group["optimizer"]([{**hyperparameters, "params": [torch.empty_like(p, device="meta") for p in trainable]}])


def refuse_bitsandbytes_overrides(optimizer: torch.optim.Optimizer, params) -> None:
    """Raise where bitsandbytes' overrides (``GlobalOptimManager``) name ``params``: pieces step instead."""
    manager = getattr(optimizer, "mng", None)  # bitsandbytes' 8-bit optimizers hold the process-wide manager
    if manager is None or not is_blockwise(type(optimizer)):
        return
    ids = {id(p) for p in params}
    named = ids & set(getattr(manager, "pid2config", {})) or any(
        id(getattr(module, name, None)) in ids
        for module, name, _ in getattr(manager, "module_weight_config_triple", ()))
    if named or getattr(manager, "index2config", None):
        raise ValueError(f"bitsandbytes' per-parameter overrides (GlobalOptimManager.override_config, "
                         f"register_parameters, register_module_override) are set, but {type(optimizer).__name__} "
                         "under zeroimpl steps pieces of the parameters, not the parameters they name, so they would "
                         "be ignored or land on other pieces: pass the setting to the optimizer for a whole param "
                         "group instead (e.g. a group of its own with optim_bits=32 under a 32-bit class such as "
                         "bitsandbytes.optim.AdamW), and clear the manager (GlobalOptimManager.get_instance()"
                         ".initialize())")
