"""Which ShardedOptimizer manages which parameter, and the parameters a model swapped out from under it.

A parameter may be managed by one live optimizer only (two would shard and step it twice). Once built, the
optimizer's parameters must stay the objects and the memory it flattened: a module that *replaces* one
(``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``) or a conversion that *rebinds* one
to other memory (``model.to(...)``, ``.half()``, ``param.data = ...``) would leave the optimizer updating
what the model no longer uses. :class:`Ownership` records the claim and :meth:`Ownership.check_unchanged`
raises, before any collective of a step, when the model no longer is what the layout describes.
"""

from __future__ import annotations

import weakref
from typing import Protocol, Sequence

import torch

from .validation import FRAMEWORK_ROUTES


class HoldsParams(Protocol):
    """A flat buffer holding parameters as views (:class:`zeroimpl.buffers.BucketStorage`)."""

    param_buffer: torch.Tensor

    def rebound_params(self) -> list[int]: ...

# id(param) -> the live claim on it. A live claim keeps its parameters alive, so an id found here always
# names the same parameter object.
_OWNERS: "weakref.WeakValueDictionary[int, Ownership]" = weakref.WeakValueDictionary()
_REGISTRATION_HOOK = None  # the global parameter-registration hook, installed with the first claim


class Ownership:
    """One optimizer's claim on its trainable parameters (held by the optimizer: it ends with it).

    Args:
        params: the trainable parameters, by parameter index (raises if another live optimizer owns one).
        frozen: the members of the param groups that were frozen (``requires_grad=False``) at construction.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], frozen: Sequence[torch.nn.Parameter]):
        if any(_OWNERS.get(id(p)) is not None for p in params):
            raise RuntimeError("a parameter is already managed by another ShardedOptimizer; delete that optimizer "
                               "(del optimizer) or build the model anew before creating another")
        self.params = list(params)
        self.frozen = list(frozen)
        self.replaced: list[str] = []  # "Module.name" of parameters a module replaced by other objects
        for param in self.params:
            _OWNERS[id(param)] = self
        _install_registration_hook()

    def check_unchanged(self, storages: Sequence["HoldsParams"]) -> None:
        """Raise if the model no longer is what the layout describes: a frozen member now requires grad, a
        parameter was replaced by another object, or one was rebound out of ``storages``' flat buffers."""
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
                "so the optimizer would keep updating the old ones. Load with assign=False (the default), or "
                "build the ShardedOptimizer after changing the model")
        rebound = [(i, s.param_buffer) for s in storages for i in s.rebound_params()]
        if rebound:
            first, home = rebound[0]
            raise RuntimeError(rebound_message([i for i, _ in rebound], self.params[first], home))


def rebound_message(param_indices: list[int], param: torch.Tensor, home: torch.Tensor) -> str:
    """Why the parameters ``param_indices`` no longer live in the optimizer's flat buffers, told from the first of
    them, ``param``, against ``home`` (a flat buffer: the dtype and device they had): a conversion, a move to
    another device, or a copy onto the same one -- which a framework's device placement makes on CPU, where
    ``.to(torch.device("cpu", 0))`` copies a tensor on ``cpu`` (accelerate and Trainer place the model so)."""
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
            f"optimizer's flat buffers: the model was {cause} after the ShardedOptimizer was built, so the optimizer "
            "would no longer update it. In your own loop: convert and move the model first, then build the "
            "optimizer (to change the model later, save a checkpoint, build a new ShardedOptimizer and load it). "
            + FRAMEWORK_ROUTES)


def _install_registration_hook() -> None:
    """Notice a module replacing a parameter that a live optimizer manages."""
    global _REGISTRATION_HOOK
    if _REGISTRATION_HOOK is None:
        _REGISTRATION_HOOK = torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_parameter_registered)


def _on_parameter_registered(module: torch.nn.Module, name: str, param) -> None:
    old = getattr(module, name, None)  # still the old parameter: the hook runs before the assignment
    owner = _OWNERS.get(id(old)) if isinstance(old, torch.Tensor) and old is not param else None
    if owner is not None:
        owner.replaced.append(f"{type(module).__name__}.{name}")
