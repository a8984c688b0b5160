"""The torch optimizers that step this rank's pieces, one per optimizer class, seen as one optimizer.

A ShardedOptimizer may mix optimizer classes (Muon for hidden matrices, AdamW for the rest): each outer
param group names its class. :class:`InnerOptimizers` builds one torch optimizer per class over the pieces
of that class's groups and presents them in the outer groups' order: ``param_groups[g]`` is outer group
``g``'s inner group, ``state`` maps every piece to its state, and ``state_dict`` / ``load_state_dict`` use
torch's format with the pieces numbered through all groups in that order, as one torch optimizer over the
same groups would number them.
"""

from __future__ import annotations

from typing import Sequence

import torch


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
