"""Which torch optimizer classes ShardedOptimizer shards, and how.

* **flat** -- elementwise optimizers (each element updated from its own parameter, gradient and state: AdamW,
  SGD, ...): every bucket is cut into equal chunks wherever the element boundaries fall.
* **whole** -- optimizers that need a whole parameter (Muon's Newton-Schulz, Adafactor's factored moments, any
  class in ``per_parameter`` such as Shampoo or SOAP): each parameter belongs to one rank, which steps it as the
  plain optimizer would.
* **blocked** -- bitsandbytes' and torchao's low-bit optimizers, recognised without flags: elementwise but for
  state quantized in blocks counted from a parameter's first element, 8-bit (4-bit, fp8) or fp32 by size
  (:func:`blocks_of`). Shards are cut on every parameter's block boundaries (:func:`zeroimpl.layout.place_blocked`),
  so every block and every fp32/8-bit choice is the unsharded optimizer's; quantization maps are replicated.
* Third-party classes checked against DDP are recognised by name, flat or whole (:data:`THIRD_PARTY_SHARDING`).
* refused -- optimizers that need several parameters at once (LBFGS's closure over the whole model) or sparse
  gradients (SparseAdam), which reduce-scatter cannot give.
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


def check_per_parameter(per_parameter) -> None:
    if isinstance(per_parameter, type) or not all(isinstance(cls, type) for cls in per_parameter):
        raise TypeError(f"per_parameter must be a list of optimizer classes, e.g. per_parameter=[MyShampoo], "
                        f"got {per_parameter!r}")


def sharding_of(optimizer_class: type, per_parameter: Collection[type], assume_elementwise: bool) -> Sharding:
    """How ``optimizer_class``'s param groups are sharded; ValueError, naming the fix, for a class that cannot be.
    ``per_parameter``: classes the user marks whole (even elementwise ones); ``assume_elementwise``: shard unknown
    classes flat."""
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
    """Whether the class scales its update by its norm against the parameter's (bitsandbytes' ``max_unorm``, on by
    default in its LAMB and LARS and their subclasses): a per-parameter norm, which a piece cannot give."""
    for cls in optimizer_class.__mro__[:-1]:  # (not object)
        try:
            setting = inspect.signature(cls.__init__).parameters.get("max_unorm")
        except ValueError:  # a constructor without a signature (an extension type's)
            continue
        if setting is not None and setting.default not in (0, 0.0, None, inspect.Parameter.empty):
            return True
    return False


def is_blockwise(optimizer_class: type) -> bool:
    """Whether the class (or a class it derives from) is a bitsandbytes or torchao optimizer."""
    return _comes_from(optimizer_class, BLOCKWISE_PACKAGES)


def _comes_from(optimizer_class: type, packages: tuple[str, ...]) -> bool:
    """Whether the class, or a class it derives from, is defined in one of ``packages`` ("name." prefixes)."""
    return any(cls.__module__.startswith(packages) for cls in optimizer_class.__mro__)


def blocks_of(group: dict) -> Blocks:
    """How a group's bitsandbytes or torchao class (``group["optimizer"]``) quantizes a tensor's state under the
    group's settings: bitsandbytes' in blocks of 256 from ``min_8bit_size`` elements on (its 32-bit classes never
    quantize: the constraint is then harmless); torchao's in blocks of ``block_size`` (AdamW8bit/Fp8 256, AdamW4bit
    128) for tensors of at least 4096 elements that the blocks divide."""
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
    """The relative cost of stepping a parameter of a given shape, which whole-parameter layouts balance across
    ranks: ``m * n * min(m, n)`` for Muon's Newton-Schulz, else the element count."""
    if optimizer_class is getattr(torch.optim, "Muon", None):
        return lambda shape: math.prod(shape) * (min(shape[-2:]) if len(shape) >= 2 else 1)
    return lambda shape: math.prod(shape)


def plan(params, optimizer_class: type, optimizer_kwargs: dict, per_parameter: Collection[type],
         assume_elementwise: bool) -> tuple[list[dict], list[Optional[Callable[[tuple], int]]], list[Optional[Blocks]]]:
    """The param groups with their classes (:func:`groups_with_classes`) and, per group, the step cost of a whole
    group (:func:`step_work`) and the quantization of a blocked one (:func:`blocks_of`), else ``None``. Raises as
    :func:`sharding_of` does."""
    check_class(optimizer_class)
    check_per_parameter(per_parameter)
    groups = groups_with_classes(params, optimizer_class, optimizer_kwargs)
    kinds = [sharding_of(group["optimizer"], per_parameter, assume_elementwise) for group in groups]
    works = [step_work(group["optimizer"]) if kind == "whole" else None for group, kind in zip(groups, kinds)]
    blocks = [blocks_of(group) if kind == "blocked" else None for group, kind in zip(groups, kinds)]
    return groups, works, blocks


def settings_of(optimizer: torch.optim.Optimizer) -> tuple[list[dict], type, dict]:
    """A torch optimizer's param groups (copies, with every hyperparameter), class and defaults (those its
    constructor takes), for a ShardedOptimizer that steps the same way. Refused once it holds state."""
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
    """Return ``replacement`` after making the ``optimizer`` it replaced share its ``param_groups`` list, so that an
    LR scheduler over ``optimizer`` (SequentialLR's children too) sets the replacement's hyperparameters; its
    ``step()`` then raises, as it would update the parameters behind the replacement's back."""
    optimizer.param_groups = replacement.param_groups

    def spent(*args, **kwargs):
        raise RuntimeError(f"this {type(optimizer).__name__} was replaced by a ShardedOptimizer "
                           "(ShardedOptimizer.from_optimizer): call step() on that one")

    optimizer.step = spent
    return replacement


def groups_with_classes(params, optimizer_class: type, optimizer_kwargs: dict) -> list[dict]:
    """Param groups (copies) with their class under ``"optimizer"`` (``optimizer_class`` where a group names none),
    ``optimizer_kwargs`` filling in the groups of ``optimizer_class`` only (other classes take their own defaults).
    Raises when ``optimizer_kwargs`` would apply to no group."""
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
        _refuse_bitsandbytes_args(group)
    if optimizer_kwargs and all(group["optimizer"] is not optimizer_class for group in groups):
        raise ValueError(f"the keyword arguments {sorted(optimizer_kwargs)} are {optimizer_class.__name__}'s, but "
                         f"every param group names another optimizer class; put them in the groups they are for, "
                         "or pass the class most groups use as optimizer_class")
    return groups


def _refuse_bitsandbytes_args(group: dict) -> None:
    """bitsandbytes' ``args=`` object overrides the keyword arguments zeroimpl reads to cut its shards
    (``min_8bit_size``) and to step whole parameters (``max_unorm``): refused."""
    if group.get("args") is not None and _comes_from(group["optimizer"], ("bitsandbytes.",)):
        raise ValueError(f"{group['optimizer'].__name__}(args=...): bitsandbytes then ignores its keyword arguments "
                         "for the settings in args, which zeroimpl reads from the keyword arguments to cut its shards "
                         "(min_8bit_size) or step whole parameters (max_unorm): pass the settings as keyword "
                         "arguments instead")


def check_whole_groups(groups: list[dict], outer_only_keys: frozenset) -> None:
    """Build each group of torch's whole-parameter classes once over meta copies of its trainable parameters, so
    that every rank, not only the owner, refuses a bad group (torch.optim.Muon: a parameter that is not 2-D).
    ``outer_only_keys``: group keys that are not hyperparameters. A user's class (which may read values) is built
    over this rank's pieces only."""
    for group in groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        if group["optimizer"] in WHOLE_PARAMETER_OPTIMIZERS and trainable:
            hyperparameters = {k: v for k, v in group.items() if k not in outer_only_keys}
            group["optimizer"]([{**hyperparameters, "params": [torch.empty_like(p, device="meta") for p in trainable]}])


def refuse_bitsandbytes_overrides(optimizer: torch.optim.Optimizer, params) -> None:
    """Raise where bitsandbytes' per-parameter overrides (``GlobalOptimManager``) could reach this inner
    ``optimizer``: they name the model's ``params`` (or positions in the plain optimizer's groups), but the inner
    optimizer steps pieces, so they would be ignored or land on other pieces."""
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
