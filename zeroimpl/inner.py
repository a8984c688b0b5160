"""The torch optimizers that step this rank's pieces, one per optimizer class, seen as one optimizer.

Megatron's "optimizer over ranges": the inner optimizers never see a model parameter. They see one tensor per
*piece* (:class:`~zeroimpl.layout.ShardPiece`: the part of one parameter in this rank's master shard), a view
of the master shard -- 1-D in flat groups, the whole parameter in its own shape in whole-parameter groups
(:func:`piece_view`). :class:`PieceMasters` makes those views and steps them; ``step_pieces`` takes
(master view, gradient view) pairs and steps only them.

A ShardedOptimizer may mix optimizer classes (Muon for hidden matrices, AdamW for the rest): each outer
param group names its class. :class:`InnerOptimizers` builds one torch optimizer per class over the pieces
of that class's groups and presents them in the outer groups' order: ``param_groups[g]`` is outer group
``g``'s inner group, ``state`` maps every piece to its state, and ``state_dict`` / ``load_state_dict`` use
torch's format with the pieces numbered through all groups in that order, as one torch optimizer over the
same groups would number them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .buffers import BucketStorage
from .layout import ShardLayout, ShardPiece
from .memory_format import shaped
from .offload import KERNEL_KEYS

# param-group keys about the model's parameters, which the inner optimizer (over pieces) does not have, and
# the group's optimizer class (not a hyperparameter: never saved with them)
OUTER_ONLY_KEYS = frozenset({"params", "param_names", "optimizer"})


class InnerOptimizers:
    """One ``optimizer_class(groups_of_that_class, **kwargs[class])`` per class in ``classes`` (outer group
    ``g`` steps with ``classes[g]``); ``groups[g]`` holds the pieces of outer group ``g`` on this rank."""

    def __init__(self, groups: Sequence[dict], classes: Sequence[type], kwargs: dict[type, dict]):
        self.classes = list(classes)
        self.optimizers: dict[type, torch.optim.Optimizer] = {}
        for optimizer_class in dict.fromkeys(classes):
            members = [group for group, cls in zip(groups, classes) if cls is optimizer_class]
            self.optimizers[optimizer_class] = optimizer_class(members, **kwargs[optimizer_class])

    @property
    def param_groups(self) -> list[dict]:
        """Outer group ``g``'s inner group, for every ``g`` (the optimizers' own dicts, which their
        ``load_state_dict`` replaces: look them up each time)."""
        return self._groups_by_class({cls: {"param_groups": optimizer.param_groups}
                                      for cls, optimizer in self.optimizers.items()})

    @property
    def defaults(self) -> dict:
        """The defaults of the first group's optimizer class."""
        return self.optimizers[self.classes[0]].defaults

    @property
    def state(self) -> dict:
        """Every piece's state (a new dict each call; the values are the optimizers' own)."""
        return {piece: state for optimizer in self.optimizers.values() for piece, state in optimizer.state.items()}

    def fill_defaults(self, outer_groups: list[dict]) -> None:
        """Give the outer groups the hyperparameters they left to the classes' defaults."""
        for outer, inner in zip(outer_groups, self.param_groups):
            for key, value in inner.items():
                outer.setdefault(key, value)

    def follow(self, outer_groups: list[dict]) -> None:
        """Take the outer groups' hyperparameters (a scheduler changes those), not the inner kernel's choice."""
        for outer, inner in zip(outer_groups, self.param_groups):
            inner.update({k: v for k, v in outer.items() if k not in OUTER_ONLY_KEYS | KERNEL_KEYS})

    def step(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()

    def state_dict(self) -> dict:
        """Torch's format, pieces numbered through the outer groups in order."""
        own = {cls: optimizer.state_dict() for cls, optimizer in self.optimizers.items()}
        state, param_groups, number = {}, [], 0
        for optimizer_class, group in zip(self.classes, self._groups_by_class(own)):
            numbers = []
            for own_number in group["params"]:
                if own_number in own[optimizer_class]["state"]:
                    state[number] = own[optimizer_class]["state"][own_number]
                numbers.append(number)
                number += 1
            param_groups.append({**group, "params": numbers})
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` of the same groups: each class's optimizer takes its groups' part."""
        if len(state_dict["param_groups"]) != len(self.classes):
            raise ValueError(f"the state has {len(state_dict['param_groups'])} param groups, this optimizer "
                             f"{len(self.classes)}")
        parts = {cls: {"state": {}, "param_groups": []} for cls in self.optimizers}
        for optimizer_class, group in zip(self.classes, state_dict["param_groups"]):
            part = parts[optimizer_class]
            first = sum(len(g["params"]) for g in part["param_groups"])
            for offset, number in enumerate(group["params"]):
                if number in state_dict["state"]:
                    part["state"][first + offset] = state_dict["state"][number]
            part["param_groups"].append({**group, "params": list(range(first, first + len(group["params"])))})
        for optimizer_class, optimizer in self.optimizers.items():
            optimizer.load_state_dict(parts[optimizer_class])

    def _groups_by_class(self, own: dict) -> list[dict]:
        """Each outer group's entry of its class's ``param_groups`` (in ``own[class]``), in outer order."""
        position = {cls: 0 for cls in own}
        groups = []
        for optimizer_class in self.classes:
            groups.append(own[optimizer_class]["param_groups"][position[optimizer_class]])
            position[optimizer_class] += 1
        return groups


def piece_view(shard: torch.Tensor, piece: ShardPiece, layout: ShardLayout, param: torch.Tensor) -> torch.Tensor:
    """The elements of ``piece`` (of parameter ``param``) in a shard-sized tensor: 1-D, or shaped as the
    parameter when its bucket is whole-parameter."""
    flat = shard[piece.shard_offset:piece.shard_offset + piece.length]
    if layout.buckets[piece.bucket_index].whole:
        return shaped(flat, param.shape, param.stride())
    return flat


class PieceMasters:
    """This rank's pieces and their views of the master shards; the inner param groups over them.

    ``masters[k]`` is piece ``k``'s view of its bucket's master (``pieces`` in ``layout.pieces(rank)`` order)."""

    def __init__(self, layout: ShardLayout, pieces: list[ShardPiece], storages: list[BucketStorage],
                 params: list[torch.nn.Parameter]):
        self.layout, self.pieces, self.params = layout, pieces, params
        self.masters = [self.view(storages[p.bucket_index].master, p) for p in pieces]

    def view(self, shard: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
        """Piece ``piece``'s elements of a shard-sized tensor (a master or a gradient shard)."""
        return piece_view(shard, piece, self.layout, self.params[piece.param_index])

    def inner_groups(self, outer_groups: list[dict]) -> list[dict]:
        """The inner optimizers' param groups: each outer group's hyperparameters over its pieces' masters."""
        groups = [{**{k: v for k, v in g.items() if k not in OUTER_ONLY_KEYS}, "params": []} for g in outer_groups]
        for piece, master in zip(self.pieces, self.masters):
            groups[self.layout.buckets[piece.bucket_index].group_index]["params"].append(master)
        return groups

    def states(self, inner: InnerOptimizers) -> list[tuple[ShardPiece, torch.Tensor, Optional[dict]]]:
        """Each piece with its master view and ``inner``'s state for it (``None``: never stepped)."""
        state = inner.state  # (a merged view, built once)
        return [(piece, master, state.get(master)) for piece, master in zip(self.pieces, self.masters)]

    def gradient_pairs(self, grads: list[Optional[torch.Tensor]], stepped: Optional[list[bool]]
                       ) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """By bucket index, the (master view, gradient view) of the pieces that step. ``grads``: per bucket,
        the gradient shard in the master's dtype, or ``None`` for a zero gradient kept by
        ``zero_grad(set_to_none=False)``; ``stepped``: by parameter index, whether some rank has a gradient
        (``None``: every parameter) -- a parameter with none is not stepped, as in torch."""
        pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for piece, master in zip(self.pieces, self.masters):
            if stepped is not None and not stepped[piece.param_index]:
                continue
            grad = grads[piece.bucket_index]
            grad = torch.zeros_like(master) if grad is None else self.view(grad, piece)
            pairs.setdefault(piece.bucket_index, []).append((master, grad))
        return pairs


def step_pieces(inner: InnerOptimizers, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Step the inner optimizers on these (master view, gradient) pairs alone: torch's optimizers skip
    parameters without a gradient, and every class zeroimpl shards updates each parameter (flat: each element)
    from its own gradient and state, so stepping the pieces in parts is bitwise stepping them at once."""
    if not pairs:
        return
    for master, grad in pairs:
        master.grad = grad
    inner.step()
    for master, _ in pairs:
        master.grad = None
