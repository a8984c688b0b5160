"""The torch optimizers that step this rank's pieces, one per optimizer class, seen as one optimizer over the outer
groups. As in Megatron's "optimizer over ranges", they never see a model parameter, only one view of the master shard
per piece (:meth:`PieceMasters.view`). Group-level state (timm's Adan step counter, schedule-free's ``k``) is the inner
optimizers': the outer groups mirror the inner ones after every step (:meth:`InnerOptimizers.report`), and before a step
only the outer values changed since (a scheduler's ``lr``) go in (:meth:`InnerOptimizers.follow`). Inner steps fire no
step hooks: the ``ShardedOptimizer.step()`` around them is the one step the user sees. As in DeepSpeed's one flat
partition per group, torch's elementwise classes step a run of pieces laid end to end as one tensor (:class:`PieceRun`;
bitwise each piece's own step, at one Python call instead of one per piece) while all its pieces step; state is saved
and loaded per piece either way."""

from __future__ import annotations

import itertools
import pickle
from typing import Optional, Sequence

import torch

from . import optimizer_kinds
from .buffers import BucketStorage
from .inflight import guards_lifted
from .layout import ShardLayout, ShardPiece
from .memory_format import shaped
from .offload import KERNEL_KEYS
from .optimizer_kinds import ELEMENTWISE_OPTIMIZERS, OUTER_ONLY_KEYS

_MOMENTUM_KEYS = frozenset({"momentum", "betas"})  # the two names of momentum in torch's optimizer classes
# ELEMENTWISE_OPTIMIZERS update elementwise given one step count: their for-loop and foreach kernels step a run of
# fp32 or fp64 pieces as one tensor bitwise as they step each piece (their fused CPU kernels do not: never run there)
_WIDE = (torch.float32, torch.float64)  # (in 16 bits torch's CPU kernels round a slice unlike the whole)


class PieceRun:
    """Consecutive pieces of one master shard in one inner group (``pieces``: their masters), stepped as one tensor,
    ``master`` (the shard's view spanning them), while their state is one: ``state``, the state of ``master`` (empty
    before its first step). Each piece's state (``shared``: the dicts handed out) holds views of its tensors and 0-dim
    tensors of its own, set to the run's after each step. ``None`` once a step left some pieces out: from then on (until
    a load) each piece steps alone. Pieces' states that are not the ones handed out (a load) are joined at the next
    step that steps them all (:meth:`gather`)."""

    def __init__(self, pieces: list[torch.Tensor], master: torch.Tensor, optimizer: torch.optim.Optimizer):
        self.pieces, self.master, self.optimizer = pieces, master, optimizer
        self.bounds = list(itertools.pairwise(itertools.accumulate((piece.numel() for piece in pieces), initial=0)))
        self.state: Optional[dict] = {}
        self.shared: list[dict] = []

    def joins_step(self) -> bool:
        """Whether the run steps as one now (``master.grad`` set); a gradient on some pieces only splits it."""
        grads = [piece.grad for piece in self.pieces]
        missing = [grad is None for grad in grads]
        if any(missing) and not all(missing):
            self.state = None
        if self.state is None or any(missing):
            return False
        states = [self.optimizer.state.get(piece) for piece in self.pieces]
        replaced = not _the_same(states, self.shared) if self.shared else any(states)  # (a load, since it shared)
        if replaced:
            self.gather()
            if self.state is None:
                return False
        self.master.grad = _joined(grads)
        return True

    def share(self) -> None:
        """Give each piece its part of ``state``: views of its tensors, copies of 0-dim ones, the other values."""
        self.shared = [{key: value[start:end] if torch.is_tensor(value) and value.dim() else
                        value.clone() if torch.is_tensor(value) else value for key, value in self.state.items()}
                       for start, end in self.bounds]
        for piece, state in zip(self.pieces, self.shared):
            self.optimizer.state[piece] = state

    def stepped(self, before: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After a step as one (``before``: the state's values before it): hand the pieces their part of a new state;
        return (a piece's 0-dim tensor, the run's) to copy: each piece's step count follows the run's."""
        if self.state and (not self.shared or not _the_same(list(self.state.values()), before)):
            self.share()  # (its first step made the state, or the class replaced a tensor)
        return [(state[key], value) for key, value in self.state.items() if torch.is_tensor(value) and not value.dim()
                for state in self.shared]

    def gather(self) -> None:
        """The pieces' states as one where they can be (same keys; tensors of each piece's size, joined; other values
        equal), else split."""
        states = [self.optimizer.state.get(piece) or {} for piece in self.pieces]
        fits = all(state.keys() == states[0].keys() for state in states)  # (a piece never stepped has none)
        joined = {key: _as_one([state[key] for state in states], self.pieces) for key in states[0]} if fits else {}
        fits = fits and all(value is not None for value in joined.values())
        self.state, self.shared = (joined if fits else None), []
        if fits and joined:
            self.share()


class InnerOptimizers:
    """One ``optimizer_class(groups_of_that_class, **kwargs[class])`` per class in ``classes`` (outer group
    ``g`` steps with ``classes[g]``); ``groups[g]`` holds the pieces of outer group ``g`` on this rank."""

    def __init__(self, groups: Sequence[dict], classes: Sequence[type], kwargs: dict[type, dict],
                 runs: Sequence[tuple[list[torch.Tensor], torch.Tensor]] = ()):
        self.classes = list(classes)
        self.optimizers = {cls: cls([group for group, its in zip(groups, classes) if its is cls], **kwargs[cls])
                           for cls in dict.fromkeys(classes)}
        holder = {id(p): (optimizer, group) for optimizer in self.optimizers.values()
                  for group in optimizer.param_groups for p in group["params"]}
        self.runs: list[PieceRun] = []  # (exact classes: a subclass may step otherwise)
        for pieces, master in runs:
            optimizer, group = holder[id(pieces[0])]
            if type(optimizer) in ELEMENTWISE_OPTIMIZERS and not group.get("fused") and master.dtype in _WIDE:
                self.runs.append(PieceRun(pieces, master, optimizer))

    @property
    def param_groups(self) -> list[dict]:
        """Outer group ``g``'s inner group, for every ``g`` (looked up each time: ``load_state_dict`` replaces them)."""
        return self._groups_by_class({cls: {"param_groups": optimizer.param_groups}
                                      for cls, optimizer in self.optimizers.items()})

    @property
    def defaults(self) -> dict:
        """Every class's defaults, the first group's class winning; ``betas`` left out where classes name momentum
        differently, so that OneCycleLR writes ``momentum``, which :meth:`follow` turns into ``betas[0]``."""
        merged: dict = {}
        for optimizer_class in self.classes:
            for key, value in self.optimizers[optimizer_class].defaults.items():
                merged.setdefault(key, value)
        if _MOMENTUM_KEYS <= {key for o in self.optimizers.values() for key in o.defaults}:
            merged.pop("betas")
        return merged

    @property
    def state(self) -> dict:
        """Every piece's state (a new dict each call; the values are the optimizers' own)."""
        return {piece: state for optimizer in self.optimizers.values() for piece, state in optimizer.state.items()}

    def follow(self, outer_groups: list[dict]) -> None:
        """Before a step: take in the outer values changed since the last sync, never the kernel choice."""
        for outer, inner, synced in zip(outer_groups, self.param_groups, self._synced):
            for key, value in outer.items():
                if key not in OUTER_ONLY_KEYS | KERNEL_KEYS and (key not in synced or synced[key] is not value):
                    synced[key] = value
                    if key == "momentum" and "momentum" not in inner and "betas" in inner:  # see defaults
                        inner["betas"] = (value, *inner["betas"][1:])
                    else:
                        inner[key] = value

    def report(self, outer_groups: list[dict]) -> None:
        """After construction (the defaults the outer groups left out), a step or a load: copy the inner groups' values
        into the outer groups; remember them as in sync."""
        self._synced = []
        for outer, inner in zip(outer_groups, self.param_groups):
            outer.update({key: value for key, value in inner.items() if key != "params"})
            self._synced.append({key: value for key, value in outer.items() if key not in OUTER_ONLY_KEYS})

    def has_mode(self, mode: str) -> bool:
        """Whether an inner optimizer has ``mode`` (``train``/``eval``: schedule-free ones), the same on all ranks."""
        return any(callable(getattr(optimizer, mode, None)) for optimizer in self.optimizers.values())

    def switch_mode(self, mode: str, outer_groups: list[dict]) -> bool:
        """Call ``mode`` on each inner optimizer that has it (:meth:`has_mode`); whether any has."""
        switching = [optimizer for optimizer in self.optimizers.values() if callable(getattr(optimizer, mode, None))]
        if switching:
            self.follow(outer_groups)
            for optimizer in switching:
                getattr(optimizer, mode)()
            self.report(outer_groups)
        return bool(switching)

    def refuse_global_clipping(self) -> None:
        """Raise for an optimizer that clips by the norm of all it steps (timm's Lamb, ``max_grad_norm``)."""
        for optimizer_class, optimizer in self.optimizers.items():
            value = next((v for v in [optimizer.defaults.get("max_grad_norm")] +
                          [g.get("max_grad_norm") for g in optimizer.param_groups] if v is not None), None)
            if value is not None:
                raise ValueError(
                    f"{optimizer_class.__name__} clips by the norm of all the gradients it steps (max_grad_norm="
                    f"{value}), but each rank steps only its own shard and would clip by its part of that norm: "
                    f"construct it with max_grad_norm=None and clip before step() with torch.nn.utils."
                    f"clip_grad_norm_(model.parameters(), {value}), which zeroimpl computes over every rank")

    @property
    def steps_in_parts(self) -> bool:
        """Whether stepping in parts (offload's pipeline) is bitwise one step: torch's classes (state per parameter)."""
        return all(type(optimizer).__module__.startswith("torch.optim") for optimizer in self.optimizers.values())

    def step(self) -> None:
        """Step the pieces that have a gradient; a run (:class:`PieceRun`) whose pieces all have one, as one tensor
        in their place, for this step only."""
        joining = {id(run.pieces[0]): run for run in self.runs if run.joins_step()}
        left_out = {id(piece) for run in joining.values() for piece in run.pieces}
        kept = [(group, group["params"]) for optimizer in self.optimizers.values() for group in optimizer.param_groups]
        before = {id(run): list(run.state.values()) for run in joining.values()}
        try:
            for group, params in kept if joining else ():
                group["params"] = [joining[id(p)].master if id(p) in joining else p for p in params
                                   if id(p) in joining or id(p) not in left_out]
            for run in joining.values():
                run.optimizer.state[run.master] = run.state
            for optimizer in self.optimizers.values():
                step = type(optimizer).step  # torch.optim.Optimizer wraps it with the hooks ("hooked") on construction
                (step.__wrapped__ if getattr(step, "hooked", False) else step)(optimizer)
        finally:
            for group, params in kept:
                group["params"] = params
            scalars = []
            for run in joining.values():
                run.state = run.optimizer.state.pop(run.master)
                run.master.grad = None
                scalars += run.stepped(before[id(run)])
            if scalars:  # (one multi-tensor copy for every run)
                torch._foreach_copy_([piece for piece, _ in scalars], [value for _, value in scalars])

    def state_dict(self) -> dict:
        """Torch's format, pieces numbered through the outer groups in order."""
        own = {cls: optimizer.state_dict() for cls, optimizer in self.optimizers.items()}
        state, param_groups, number = {}, [], 0
        for optimizer_class, group in zip(self.classes, self._groups_by_class(own)):
            saved = own[optimizer_class]["state"]
            state.update({number + k: saved[own_number] for k, own_number in enumerate(group["params"])
                          if own_number in saved})
            param_groups.append({**group, "params": list(range(number, number + len(group["params"])))})
            number += len(group["params"])
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
            part["state"].update({first + offset: state_dict["state"][number]
                                  for offset, number in enumerate(group["params"]) if number in state_dict["state"]})
            part["param_groups"].append({**group, "params": list(range(first, first + len(group["params"])))})
        for optimizer_class, optimizer in self.optimizers.items():
            optimizer.load_state_dict(parts[optimizer_class])
        for run in self.runs:  # (a split one too: joined at the next step that steps all its pieces, if they agree)
            run.state, run.shared = {}, []

    def _groups_by_class(self, own: dict) -> list[dict]:
        """Each outer group's entry of its class's ``param_groups`` (in ``own[class]``), in outer order."""
        remaining = {cls: iter(own[cls]["param_groups"]) for cls in own}
        return [next(remaining[cls]) for cls in self.classes]


def build_on_every_rank(groups: Sequence[dict], classes: Sequence[type], kwargs: dict[type, dict], topology,
                        params: Sequence[torch.Tensor], runs: Sequence[tuple[list[torch.Tensor], torch.Tensor]] = ()
                        ) -> InnerOptimizers:
    """:class:`InnerOptimizers` over this rank's pieces of ``params``. Collective unless ``topology`` is ``None``:
    a refusal on one rank (a shape only it owns) raises the same error on every rank, never a later hang."""
    error, inner, refused = None, None, None
    try:
        inner = InnerOptimizers(groups, classes, kwargs, runs)
        for optimizer in inner.optimizers.values():
            optimizer_kinds.refuse_bitsandbytes_overrides(optimizer, params)
        if topology is not None and topology.shard_size > 1:  # (None: refused at construction already)
            inner.refuse_global_clipping()
    except Exception as exc:  # any refusal by a class's constructor: shared below, then raised everywhere
        error = exc
    if topology is not None:
        gathered = topology.all_gather_objects(None if error is None else _portable(error),
                                               "inner optimizer construction agreement")
        refused = next(((rank, found) for rank, found in enumerate(gathered) if found is not None), None)
    if error is not None:
        raise error
    if refused is None:
        return inner
    rank, (error_class, message) = refused
    note = f"(rank {rank} in all-gather order, building its inner optimizer) {message}"
    try:
        raised = error_class(note)
    except Exception:  # a class whose constructor takes other arguments
        raised = RuntimeError(f"{error_class.__name__}: {note}")
    raise raised


def _portable(error: Exception) -> tuple[type, str]:
    """The error's class (when it pickles: a module-level class) and message, to send to the other ranks."""
    try:
        pickle.dumps(type(error))
        return type(error), str(error)
    except Exception:
        return RuntimeError, f"{type(error).__name__}: {error}"


class PieceMasters:
    """This rank's pieces (``layout.pieces(rank)`` order) and ``masters[k]``, piece ``k``'s view of its master."""

    def __init__(self, layout: ShardLayout, pieces: list[ShardPiece], storages: list[BucketStorage],
                 params: list[torch.nn.Parameter]):
        self.layout, self.pieces, self.params = layout, pieces, params
        self.masters = [self.view(storages[p.bucket_index].master, p) for p in pieces]

    def view(self, shard: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
        """``piece``'s elements of a shard-sized tensor: 1-D, or shaped as its parameter in a whole-parameter bucket."""
        flat = shard[piece.shard_offset:piece.shard_offset + piece.length]
        if not self.layout.buckets[piece.bucket_index].whole:
            return flat
        param = self.params[piece.param_index]
        return shaped(flat, param.shape, param.stride())

    def inner_groups(self, outer_groups: list[dict]) -> list[dict]:
        """The inner optimizers' param groups: each outer group's hyperparameters over its pieces' masters."""
        groups = [{**{k: v for k, v in g.items() if k not in OUTER_ONLY_KEYS}, "params": []} for g in outer_groups]
        for piece, master in zip(self.pieces, self.masters):
            groups[self.layout.buckets[piece.bucket_index].group_index]["params"].append(master)
        return groups

    def runs(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Each run of two or more pieces laid end to end in a flat bucket's shard: their masters, and the master's
        view that spans them."""
        runs, current = [], []
        for piece, master in zip(self.pieces, self.masters):
            bucket = self.layout.buckets[piece.bucket_index]
            last = current[-1][0] if current else None
            if last is None or (last.bucket_index, last.shard_offset + last.length) != (bucket.index,
                                                                                        piece.shard_offset):
                runs.append(current)
                current = []
            if not bucket.whole and not bucket.block:
                current.append((piece, master))
        runs.append(current)
        return [([master for _, master in run], _joined([master for _, master in run])) for run in runs if len(run) > 1]

    def states(self, inner: InnerOptimizers) -> list[tuple[ShardPiece, torch.Tensor, Optional[dict]]]:
        """Each piece with its master view and ``inner``'s state for it (``None``: never stepped)."""
        state = inner.state  # (a merged view, built once)
        return [(piece, master, state.get(master)) for piece, master in zip(self.pieces, self.masters)]

    def gradient_pairs(self, grads: list[Optional[torch.Tensor]], stepped: Optional[list[bool]]
                       ) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """By bucket index, the (master view, gradient view) of the pieces that step. ``grads``: per bucket, the shard
        (``None``: zeros); ``stepped``: by parameter index, whether some rank has a gradient (``None``: all)."""
        pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for piece, master in zip(self.pieces, self.masters):
            if stepped is not None and not stepped[piece.param_index]:
                continue
            grad = grads[piece.bucket_index]
            grad = torch.zeros_like(master) if grad is None else self.view(grad, piece)
            pairs.setdefault(piece.bucket_index, []).append((master, grad))
        return pairs


def step_pieces(inner: InnerOptimizers, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Step the inner optimizers on these (master, gradient) pairs only (:attr:`InnerOptimizers.steps_in_parts`)."""
    if not pairs:
        return
    for master, grad in pairs:
        master.grad = grad
    with guards_lifted():  # (the inner step may be compiled code, which cannot trace a guard)
        inner.step()
    for master, _ in pairs:
        master.grad = None


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` end to end as one 1-D tensor: a view where they lie so in one storage, else a copy."""
    first, offset = tensors[0], tensors[0].storage_offset()
    for tensor in tensors:
        if (tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or tensor.dtype != first.dtype
                or tensor.storage_offset() != offset or not tensor.is_contiguous()):
            return torch.cat([tensor.reshape(-1) for tensor in tensors])
        offset += tensor.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def _as_one(values: list, pieces: list[torch.Tensor]):
    """A run's value of one state key from its pieces': tensors of each piece's size joined (:func:`_joined`), other
    values equal on every piece taken once; ``None`` if neither."""
    first = values[0]
    if torch.is_tensor(first) and first.dim():
        fits = all(torch.is_tensor(value) and value.shape == piece.shape for value, piece in zip(values, pieces))
        return _joined(values) if fits else None
    if all(torch.is_tensor(value) and torch.equal(value, first) if torch.is_tensor(first) else value == first
           for value in values):
        return first.clone() if torch.is_tensor(first) else first
    return None


def _the_same(these: list, those: list) -> bool:
    """Whether two lists hold the same objects (``is``: a tensor's ``==`` compares values)."""
    return len(these) == len(those) and all(this is that for this, that in zip(these, those))
