"""A ShardedOptimizer and its model as ``torch.distributed.checkpoint`` (DCP) sees a DDP or FSDP2 model with a
torch optimizer: :class:`DCPState`, a ``Stateful`` for ``dcp.save``, ``dcp.async_save`` and ``dcp.load``.

Its ``state_dict()`` has the keys, full shapes and dtypes of ``get_state_dict(model, torch_optimizer,
options=StateDictOptions(flatten_optimizer_state_dict=True))`` for the same model and the same torch optimizer
classes and groups: ``{"model": {fqn: tensor}, "optim": {"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<key>":
value}}``, so that one checkpoint moves between zeroimpl, DDP and FSDP2 (torchtitan's checkpointer saves that
structure), at any world size.

What each rank contributes: a parameter's master weights (the ``model`` entry of a trainable parameter) and
its per-element optimizer state are :class:`FlatRanges`: a tensor of the parameter's full shape whose data are
this rank's ranges of it, described to DCP as the boxes they cover (a contiguous range of a row-major tensor is a
few boxes: :func:`boxes`), with no copy and nothing gathered; DCP writes each rank's boxes and reads into them
from whatever boxes another job wrote. A scalar state (Adam's ``step``) is a plain tensor on the ranks that hold a
piece of its parameter, and frozen parameters and buffers are plain tensors on every rank (DCP writes identical
entries once). A load writes in place into the masters and the state, then all-gathers the parameters from the
masters (:meth:`DCPState.load_state_dict`).

Decisions: the ``model`` entries of trainable parameters are the masters, fp32 or fp64 (for a 16-bit model, fp32 where
``get_state_dict`` of the 16-bit model would give its dtype: what FSDP2's mixed precision saves, its sharded fp32
parameters); an optimizer that has not stepped on any rank has the placeholder state ``get_state_dict`` gives a
torch optimizer (:func:`_fresh_state`), which it does not take unless a load fills it; once any rank has stepped, a
parameter without gradients so far has no state entries, as in torch's. Refused by name: fp16 loss scaling (DCP's
format has no place for the loss scale), ``quantize_param_gather`` (its published parameters are not the
masters), low-bit optimizers (their state is codes and scales, not torch's) and parameters in another memory
format than contiguous.

``dcp.async_save`` runs its last collective on a thread of its own: give it a process group of its own
(``process_group=dist.new_group(backend="gloo")``, as torchtitan does), or it meets the training's collectives on
the default group and both wait until the timeout.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from ..optimizer import ShardedOptimizer
from ..state_format import CheckpointError
from .format import model_state, param_names

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a box of a tensor


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes, in row-major order, that cover the flat elements ``[start, end)`` of a row-major tensor of
    ``shape``: at most a partial box at each end per dimension and one of whole rows between, each contiguous."""
    if start >= end:
        return []
    if not shape:  # a 0-dim tensor: its one element is the box of no dimensions
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    found = []
    if start % inner:  # the rest of a first, partial row
        row, stop = start // inner, min(end, (start // inner + 1) * inner)
        found += [((row, *offsets), (1, *sizes)) for offsets, sizes in boxes(shape[1:], start - row * inner,
                                                                             stop - row * inner)]
        start = stop
    whole = (end - start) // inner
    if whole:
        found.append(((start // inner, *(0,) * (len(shape) - 1)), (whole, *shape[1:])))
        start += whole * inner
    if start < end:  # the beginning of a last, partial row
        found += [((start // inner, *offsets), (1, *sizes)) for offsets, sizes in boxes(shape[1:], 0, end - start)]
    return found


class FlatRanges(torch.Tensor):
    """A tensor of a parameter's full ``shape`` that holds only this rank's flat ranges of it: ``ranges`` is a list
    of (first flat element, 1-D values), the values views of the optimizer's own tensors. It answers DCP's
    checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, as
    DTensor does) with one chunk per box; any other torch operation on it raises."""

    @staticmethod
    def __new__(cls, shape: torch.Size, ranges: list[tuple[int, torch.Tensor]], dtype: torch.dtype,
                device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        tensor.ranges = ranges
        tensor.chunks = [chunk for start, values in ranges for chunk in _boxes_of(tuple(shape), start, values)]
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.new_empty.default:  # dcp.async_save's staging: an empty one, then its attributes
            tensor, size = args[0], args[1]
            return FlatRanges(torch.Size(size), [], (kwargs or {}).get("dtype") or tensor.dtype,
                              (kwargs or {}).get("device") or tensor.device)
        raise CheckpointError(f"{func} on a FlatRanges: it stands for a parameter's full tensor in a "
                              "torch.distributed.checkpoint state dict, and holds only this rank's ranges")

    def __create_write_items__(self, fqn: str, tensor: "FlatRanges") -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets), number), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=TensorProperties.create_from_tensor(values), size=self.shape))
                for number, ((offsets, sizes), values) in enumerate(self.chunks)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for (offsets, sizes), _ in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for (offsets, _), values in self.chunks:
            if torch.Size(offsets) == index.offset:
                return values
        raise CheckpointError(f"{index.fqn} has no box at {tuple(index.offset)} on this rank")


def _boxes_of(shape: tuple[int, ...], start: int, values: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """Each box of the flat range ``[start, start + len(values))`` with its view of ``values``."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    found = []
    for offsets, sizes in boxes(shape, start, start + values.numel()):
        first = sum(o * s for o, s in zip(offsets, strides)) - start
        found.append(((offsets, sizes), values[first:first + math.prod(sizes)].view(sizes)))
    return found


class DCPState(Stateful):
    """``model`` and its :class:`ShardedOptimizer` as one DCP ``Stateful``, saved as a DDP or FSDP2 job with the same
    torch optimizer saves them; ``dcp.load`` reads either, at any world size, stage, offload or mesh. Raises
    ``CheckpointError`` at construction for what docs/checkpoints.md refuses."""

    def __init__(self, model: torch.nn.Module, optimizer: ShardedOptimizer) -> None:
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"DCPState(model, optimizer) takes the model and then a ShardedOptimizer, got "
                            f"{type(model).__name__} and {type(optimizer).__name__}")
        refusal = _refusal(optimizer)
        if refusal:
            raise CheckpointError(f"DCPState cannot hold this optimizer: {refusal}; save it with "
                                  "zeroimpl.checkpoint.save_checkpoint instead")
        self.model, self.optimizer = _bare(model), optimizer

    def state_dict(self) -> dict:
        """``{"model", "optim"}`` in ``get_state_dict``'s flattened layout: views of this rank's masters and state,
        which ``dcp.load`` fills. Collective."""
        optimizer = self.optimizer
        optimizer.sync_masters()  # (the gathers in flight finished; parameters edited since the last step taken in)
        names = [first for first, *_ in param_names(optimizer, self.model)]
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        pieces = optimizer.piece_states()
        # as get_state_dict gives a torch optimizer: placeholder state where no rank has any (nothing stepped yet),
        # else only the state there is (a parameter without gradients so far has none, in torch's too)
        fresh = not any(optimizer.topology.all_gather_objects(
            any(state is not None for _, _, state in pieces), "DCPState (whether any rank holds state)"))
        placeholders = {}
        if fresh:  # (the same on every rank: the agreement that follows only then)
            error = None
            try:
                placeholders = {number: _fresh_state(group_of[id(optimizer.trainable_params[piece.param_index])],
                                                     master) for number, (piece, master, _) in enumerate(pieces)}
            except CheckpointError as caught:  # every rank must raise, not only those holding such a piece
                error = str(caught)
            failures = [failure for failure in optimizer.topology.all_gather_objects(
                error, "DCPState (placeholder state)") if failure is not None]
            if failures:
                raise CheckpointError(failures[0])
        # (piece, master view, state or None) in piece_states() order: what a load then installs
        self._pieces = [(piece, master, placeholders.get(number, state))
                        for number, (piece, master, state) in enumerate(pieces)]
        by_param: list[list] = [[] for _ in optimizer.trainable_params]
        for entry in self._pieces:
            by_param[entry[0].param_index].append(entry)
        trainable = {id(p): i for i, p in enumerate(optimizer.trainable_params)}
        model = {name: (self._ranges(trainable[id(tensor)], by_param, None) if id(tensor) in trainable
                        else tensor.detach())
                 for name, tensor in model_state(self.model, keep_vars=True).items()}
        optim = {}
        for i, name in enumerate(names):
            for key, value in self._state_of(i, by_param).items():
                optim[f"state.{name}.{key}"] = value
        for group, members in zip(optimizer.param_groups, self._member_names()):
            for name in members:  # (frozen members too: torch's optimizer holds them)
                for key in _hyperparameter_keys(group):
                    optim[f"param_groups.{name}.{key}"] = group[key]
        return {"model": model, "optim": optim}

    def _member_names(self) -> list[list[str]]:
        """Each param group's members by their first state-dict name."""
        first = {}
        for name, tensor in model_state(self.model, keep_vars=True).items():
            first.setdefault(id(tensor), name)
        return [[first[id(p)] for p in group["params"] if id(p) in first] for group in self.optimizer.param_groups]

    def _ranges(self, index: int, by_param: list[list], key: Optional[str]) -> FlatRanges:
        """Parameter ``index``'s masters (``key`` None) or per-element state ``key`` as this rank's ranges (none
        on a rank that holds no piece of it)."""
        param = self.optimizer.trainable_params[index]
        # (view, never reshape: a load writes through these into the masters and the state)
        ranges = [(piece.param_start, (master if key is None else state[key]).view(-1))
                  for piece, master, state in by_param[index]]
        master = self.optimizer.storages[self.optimizer.layout.slots[index].bucket_index].master
        like = ranges[0][1] if ranges else master
        return FlatRanges(param.shape, ranges, like.dtype, like.device)

    def _state_of(self, index: int, by_param: list[list]) -> dict:
        """Parameter ``index``'s optimizer state by key, on the ranks that hold a piece of it: per element as
        :class:`FlatRanges`; a scalar tensor (Adam's ``step``) and a tensor of a parameter held whole (Adafactor's
        ``row_var``) as they are; a plain value (saved as bytes) as it is."""
        if not by_param[index]:
            return {}
        piece, master, state = by_param[index][0]
        if state is None:
            return {}
        whole = piece.param_start == 0 and piece.param_end == self.optimizer.trainable_params[index].numel()
        found = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape == master.shape:
                found[key] = self._ranges(index, by_param, key)
            elif not torch.is_tensor(value) or value.dim() == 0 or whole:
                found[key] = value
            else:
                raise CheckpointError(f"optimizer state {key!r} of trainable parameter {index} "
                                      f"({tuple(value.shape)}) is neither per element nor a scalar, and the "
                                      "parameter is split between ranks: DCP's format cannot carry it")
        return found

    def load_state_dict(self, state_dict: dict) -> None:
        """After ``dcp.load``: install the state and hyperparameters, all-gather the parameters. Collective."""
        optimizer, optim = self.optimizer, state_dict["optim"]
        names = [first for first, *_ in param_names(optimizer, self.model)]
        hyperparameters = []
        for number, (group, members) in enumerate(zip(optimizer.param_groups, self._member_names())):
            values = [{key: optim[f"param_groups.{name}.{key}"] for key in _hyperparameter_keys(group)}
                      for name in members]
            if any(value != values[0] for value in values):
                raise CheckpointError(f"the checkpoint's hyperparameters differ between the parameters of param "
                                      f"group {number} ({', '.join(members)}): it was saved with other param groups")
            hyperparameters.append(values[0] if values else {})
        states = []
        for piece, _, state in self._pieces:  # values DCP loads as bytes come back in the dict, not in place
            states.append(None if state is None else {
                key: value if torch.is_tensor(value) else optim[f"state.{names[piece.param_index]}.{key}"]
                for key, value in state.items()})
        optimizer.restore_state(states, hyperparameters, [storage.master for storage in optimizer.storages])
        self._pieces = []  # (installed: held here too, a run's joining copy would keep the loaded state twice)


def _fresh_state(group: dict, master: torch.Tensor) -> dict:
    """Placeholder state for a piece of an optimizer that has not stepped: what ``get_state_dict`` gives a torch
    optimizer that has not stepped, which steps it once on zero gradients at learning rate 0. The same step, of a
    new optimizer of the group's class and hyperparameters, on a copy of the piece: the optimizer itself keeps no
    state until a load installs it."""
    stand_in = torch.nn.Parameter(master.detach().clone())
    stand_in.grad = torch.zeros_like(stand_in)
    try:
        probe = group["optimizer"]([stand_in], lr=0.0)
        probe.param_groups[0].update({key: group[key] for key in _hyperparameter_keys(group)
                                      if key in probe.param_groups[0] and key != "lr"})
        probe.step()
    except Exception as error:  # noqa: BLE001 - any class that cannot be built or stepped so
        raise CheckpointError(f"DCPState needs the state of an optimizer that has not stepped yet, as get_state_dict "
                              f"gives it, and a {group['optimizer'].__name__} over a copy of a parameter cannot be "
                              f"built with lr=0 and stepped ({type(error).__name__}: {error}): take a training step "
                              "before saving or loading through DCPState") from error
    return probe.state[stand_in]


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    """The model under its DDP and ``torch.compile`` wrappers, in any order, as ``get_state_dict`` names it."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                       torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _hyperparameter_keys(group: dict) -> list[str]:
    """The keys of a param group that torch's optimizer of its class also has: all but its members (and
    zeroimpl's per-group ``optimizer``)."""
    return [key for key in group if key not in ("params", "param_names", "optimizer")]


def _refusal(optimizer: ShardedOptimizer) -> Optional[str]:
    """Why DCP's format cannot carry this optimizer, or None."""
    if optimizer.loss_scaler is not None:
        return "it scales the loss (fp16), and DCP's format has no place for the loss scale"
    if any(storage.published is not None for storage in optimizer.storages):
        return "quantize_param_gather publishes parameters that are not the masters"
    if any(bucket.block for bucket in optimizer.layout.buckets):
        return "a low-bit optimizer keeps codes and scales, not torch's state"
    contiguous = [p.is_contiguous() for p in optimizer.trainable_params]
    if not all(contiguous):
        return (f"trainable parameter {contiguous.index(False)} is not contiguous (another memory format): "
                "its ranges are not boxes of the tensor")
    return None
