"""Which ShardedOptimizer manages which parameter (one live optimizer per parameter, or it is stepped twice), and the
parameters a model swapped out from under it: *replaced* by a module (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``) or *rebound* to other memory (``model.to(...)``, ``param.data = ...``). Before
the first step the optimizer follows such changes (:class:`ModelFollower`); after it, :meth:`Ownership.check_unchanged`
raises before any collective."""

from __future__ import annotations

import weakref
from typing import Protocol, Sequence

import torch

from .validation import FRAMEWORK_ROUTES


class HoldsParams(Protocol):
    """A flat buffer holding parameters as views (:class:`zeroimpl.buffers.BucketStorage`)."""

    param_buffer: torch.Tensor

    def rebound_params(self) -> list[int]: ...

# id(param) -> the live claim on it, which keeps it alive: an id found here always names the same object
_OWNERS: "weakref.WeakValueDictionary[int, Ownership]" = weakref.WeakValueDictionary()
# id(a Parameter that replaced an owned one) -> the live claim it succeeds into (a claim holds its successors)
_HEIRS: "weakref.WeakValueDictionary[int, Ownership]" = weakref.WeakValueDictionary()
# id(frozen member of the param groups) -> the live claim whose groups hold it (several may)
_FROZEN_OWNERS: "weakref.WeakValueDictionary[int, Ownership]" = weakref.WeakValueDictionary()
_REGISTRATION_HOOK = None  # the global parameter-registration hook, installed with the first claim
_OPEN_FOLLOWERS: "weakref.WeakSet[ModelFollower]" = weakref.WeakSet()  # of optimizers not stepped yet
_FORWARD_HOOK = None  # the module-level forward pre-hook, installed with the first follower


class Ownership:
    """An optimizer's claim (ending with it) on its trainable ``params`` (by index) and groups' ``frozen`` members."""

    def __init__(self, params: Sequence[torch.nn.Parameter], frozen: Sequence[torch.nn.Parameter]):
        if any(_OWNERS.get(id(p)) is not None for p in params):
            raise RuntimeError("a parameter is already managed by another ShardedOptimizer; delete that optimizer "
                               "(del optimizer) or build the model anew before creating another")
        self.params, self.frozen = list(params), list(frozen)
        self.replaced: list[str] = []  # "Module.name" of parameters a module replaced by other objects
        self.successors: dict[int, torch.nn.Parameter] = {}  # id(owned parameter, frozen too) -> its replacement
        _OWNERS.update({id(param): self for param in self.params})
        _FROZEN_OWNERS.update({id(param): self for param in self.frozen})
        _install_registration_hook()

    def _succeed(self, original: int, param: torch.nn.Parameter) -> None:
        """``param`` replaces the owned parameter of id ``original`` (directly, or a replacement of it)."""
        self.successors[original] = param
        _HEIRS[id(param)] = self

    def release(self) -> None:
        """Give up the claim (a new one over the parameters as the model now holds them replaces it)."""
        for registry, params in ((_OWNERS, self.params), (_FROZEN_OWNERS, self.frozen)):
            for param in params:
                if registry.get(id(param)) is self:
                    del registry[id(param)]

    def check_unchanged(self, storages: Sequence["HoldsParams"]) -> None:
        """Raise if the model left the layout: a frozen member requires grad, a parameter was replaced or rebound."""
        unfrozen = [i for i, p in enumerate(self.frozen) if p.requires_grad]
        if unfrozen:
            raise RuntimeError(
                f"{len(unfrozen)} parameter(s) of the param groups were frozen (requires_grad=False) when the "
                "ShardedOptimizer was built and now require grad; the shard layout is fixed, so they would never "
                "be trained. Build the optimizer with every parameter you will train unfrozen and freeze what "
                "you need afterwards (a parameter without a gradient is not updated, as in torch), or delete this "
                "optimizer and build a new ShardedOptimizer after unfreezing (a checkpoint carries the state over)")
        if self.replaced:
            raise RuntimeError(
                f"the model replaced parameters that this optimizer manages ({', '.join(self.replaced[:5])}) "
                "with other Parameter objects (load_state_dict(assign=True), module.weight = nn.Parameter(...)), "
                "after the optimizer had taken gradients or stepped, so it would keep updating the old ones. Load with "
                "assign=False (the default), or change the model before the first backward")
        rebound = [(i, s.param_buffer) for s in storages for i in s.rebound_params()]
        if rebound:
            raise RuntimeError(rebound_message([i for i, _ in rebound], self.params[rebound[0][0]], rebound[0][1]))


def rebound_message(param_indices: list[int], param: torch.Tensor, home: torch.Tensor) -> str:
    """Why trainable parameters ``param_indices`` left the flat buffers, told from the first, ``param``, against its
    buffer ``home``: a conversion, a move, or a copy onto the same device (``.to("cpu:0")`` copies a ``cpu`` tensor)."""
    if param.dtype != home.dtype:
        cause = f"converted from {home.dtype} to {param.dtype} (.half(), .double(), .to(dtype))"
    elif param.device.type != home.device.type or (param.device.type != "cpu" and param.device != home.device):
        cause = f"moved from {home.device} to {param.device} (model.to(device))"
    else:
        cause = ("copied onto the device it was already on, which is what a framework's device placement does "
                 "(accelerate's prepare and transformers' Trainer move the model to cpu:0 on CPU, and .to() copies "
                 "it; both would then wrap it in DistributedDataParallel, which all-reduces the gradients this "
                 "optimizer reduces itself); param.data = ... and resize_token_embeddings copy too")
    return (f"trainable parameters {param_indices[:5]} (the optimizer's numbering) no longer live in the "
            f"optimizer's flat buffers: the model was {cause} after the ShardedOptimizer was built, and it could not "
            "follow: it follows such a change at the next forward outside torch.compile, or at the first step, but "
            "not once it has taken gradients or stepped, so it would no longer update the model. In your own loop: "
            "convert and move the model before the first backward, and run a forward outside torch.compile first "
            "(to change the model later, save a checkpoint, build a new ShardedOptimizer and load it). "
            + FRAMEWORK_ROUTES)


def _install_registration_hook() -> None:
    """Notice a module replacing a parameter that a live optimizer manages."""
    global _REGISTRATION_HOOK
    if _REGISTRATION_HOOK is None:
        _REGISTRATION_HOOK = torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_parameter_registered)


def _on_parameter_registered(module: torch.nn.Module, name: str, param) -> None:
    old = getattr(module, name, None)  # still the old parameter: the hook runs before the assignment
    if not isinstance(old, torch.Tensor) or old is param:
        return
    heir_of = _HEIRS.get(id(old))  # a replacement replaced again: the owned parameter's successor is the new one
    if heir_of is not None:
        original = next(key for key, heir in heir_of.successors.items() if heir is old)
        del heir_of.successors[original], _HEIRS[id(old)]
        if (isinstance(param, torch.nn.Parameter) and param.shape == old.shape
                and param.requires_grad == old.requires_grad):
            heir_of._succeed(original, param)
        return
    frozen_owner = _FROZEN_OWNERS.get(id(old))
    if frozen_owner is not None and isinstance(param, torch.nn.Parameter) and not param.requires_grad:
        frozen_owner._succeed(id(old), param)  # (out of the layout: followed, or nothing to follow)
    owner = _OWNERS.get(id(old))
    if owner is not None:
        owner.replaced.append(f"{type(module).__name__}.{name}")
        if isinstance(param, torch.nn.Parameter) and param.shape == old.shape and param.requires_grad:
            owner._succeed(id(old), param)


class ModelFollower:
    """Until :meth:`close` (the first step), calls ``follow`` (held weakly) before any module's forward once
    ``ownership`` has a successor, and before the forward of a module whose parameters left where :meth:`remember` saw
    them. One global pre-hook serves all, never removed (a compiled forward would recompile)."""

    def __init__(self, follow, ownership: Ownership):
        self._follow = weakref.WeakMethod(follow)
        self.ownership = ownership
        self._addresses: dict[int, int] = {}  # id(owned trainable parameter) -> its data_ptr when remembered
        _OPEN_FOLLOWERS.add(self)
        _install_forward_hook()

    def remember(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._addresses = {id(p): p.data_ptr() for p in params}

    def before_forward(self, module: torch.nn.Module) -> None:
        addresses = self._addresses
        # a compiled module runs its original's forward below the hooks: its parameters are all the original's
        params = module.parameters() if type(module).__name__ == "OptimizedModule" else module._parameters.values()
        moved = any(id(p) in addresses and p.data_ptr() != addresses[id(p)] for p in params if p is not None)
        if moved or self.ownership.successors:
            if (follow := self._follow()) is not None:
                follow()

    def close(self) -> None:
        _OPEN_FOLLOWERS.discard(self)


def _install_forward_hook() -> None:
    global _FORWARD_HOOK
    if _FORWARD_HOOK is None:
        _FORWARD_HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_before_any_forward)


def _before_any_forward(module: torch.nn.Module, args) -> None:
    if not torch.compiler.is_compiling() and _OPEN_FOLLOWERS:
        for follower in list(_OPEN_FOLLOWERS):
            follower.before_forward(module)
