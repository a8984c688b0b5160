"""Between sharded checkpoints and torch's own formats, in one process (no process group needed).

* :func:`export_fp32_state_dict` -- the model's full fp32 weights from a sharded checkpoint (as DeepSpeed's
  ``zero_to_fp32``): a ``model.load_state_dict``-ready dict.
* :func:`consolidated_optimizer_state_dict` -- the full, unsharded optimizer state in the standard
  ``torch.optim.Optimizer.state_dict()`` format, for the plain inner optimizer built over the model's
  parameters with the same param groups.
* :func:`load_torch_optimizer_state` -- the reverse: start sharded training from a plain torch optimizer's
  state dict (on every rank; no communication).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..memory_format import flattened, shaped
from ..optimizer import ShardedOptimizer
from ..state_format import (CheckpointError, block_range, describe_groups, is_per_block, joined, plain_parts,
                            require_logical_order, split_state)
from . import files
from .files import EXTRAS, INDEX
from .format import (READABLE_FORMATS, file_keys, key_offsets, param_scalars, read_rank, saved_layout,
                     saved_memory_order, state_dtypes)


def _read_full(directory: str):
    """(directory, index, saved layout, full flat masters per parameter, per parameter its full per-element
    state by key (flat) and its whole-parameter state by key)."""
    directory = files.resolve_directory(directory)
    index = files.read(directory, INDEX, None)
    if not isinstance(index, dict) or index.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"not a zeroimpl checkpoint (the index has no format tag {READABLE_FORMATS[-1]!r})")
    layout = saved_layout(index)
    numels = [slot.numel for slot in layout.slots]
    keys_of, dtypes_of = file_keys(index, layout), state_dtypes(index)
    masters = [None] * len(numels)
    states: list[dict[str, torch.Tensor]] = [{} for _ in numels]
    for rank in range(layout.world_size):
        payload = read_rank(directory, index, layout, rank, keys_of)
        pieces = layout.pieces(rank)
        offsets, offset = key_offsets(pieces, keys_of), 0
        for number, piece in enumerate(pieces):
            i, target = piece.param_index, slice(piece.param_start, piece.param_end)
            if masters[i] is None:
                masters[i] = torch.empty(numels[i], dtype=payload["master"].dtype)
            masters[i][target] = payload["master"][offset:offset + piece.length]
            for key in keys_of[i]:
                values, start = payload["state"][key], offsets[key][number]
                dtype = dtypes_of[i].get(key, values.dtype)
                states[i].setdefault(key, torch.empty(numels[i], dtype=dtype))[target] = values[start:start + piece.length]
            block = layout.buckets[piece.bucket_index].block
            for key, value in payload["whole_state"].get(i, {}).items():
                if block and is_per_block(key):  # a low-bit piece's scales: its blocks of the whole parameter's
                    first, last = block_range(piece.param_start, piece.param_end, block)
                    states[i].setdefault(key, torch.empty(-(-numels[i] // block), dtype=value.dtype))[first:last] = value
                else:
                    states[i][key] = value
            offset += piece.length
    return directory, index, layout, masters, states


def export_fp32_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights from a sharded checkpoint: trainable parameters from the fp32 master weights
    (tied names share one tensor), frozen parameters and buffers as saved (floating ones in fp32)."""
    directory, index, _, masters, _ = _read_full(directory)
    state = {}
    for entry, flat in zip(index["params"], masters):
        tensor = shaped(flat.to(torch.float32), entry["shape"], saved_memory_order(entry))
        for name in entry["names"]:
            state[name] = tensor
    extras = files.read(directory, EXTRAS, index["files"][EXTRAS])
    for name, tensor in extras.items():
        state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def consolidated_optimizer_state_dict(directory: str, groups: Optional[Sequence[int]] = None) -> dict:
    """The checkpoint's optimizer state as ``torch.optim.Optimizer.state_dict()`` of the plain inner optimizer,
    built over the same param groups (frozen members included, as torch numbers them).

    ``groups``: only these param groups (by position), as the state of a plain optimizer built over them
    alone -- with several optimizer classes, one call per class, e.g. ``groups=[0]`` for torch.optim.Muon
    over group 0 and ``groups=[1, 2]`` for torch.optim.AdamW over groups 1 and 2. Default: every group."""
    _, index, layout, _, states = _read_full(directory)
    scalars_of = param_scalars(index, layout)
    numels = [slot.numel for slot in layout.slots]
    chosen = range(len(index["groups"])) if groups is None else list(groups)
    if not all(isinstance(g, int) and 0 <= g < len(index["groups"]) for g in chosen):
        raise ValueError(f"groups must be positions of the checkpoint's {len(index['groups'])} param groups, "
                         f"got {groups!r}")
    state, param_groups, number = {}, [], 0
    for group in (index["groups"][g] for g in chosen):
        numbers = []
        for member in group["members"]:
            if member >= 0:
                scalars = scalars_of[member]
                if scalars is not None:
                    entry = index["params"][member]
                    strides = saved_memory_order(entry)
                    parts = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                             **{key: shaped(value, entry["shape"], strides) if value.numel() == numels[member] else value
                                for key, value in states[member].items()}}
                    require_logical_order(parts, entry["shape"], strides, member)
                    state[number] = joined(parts, tuple(entry["shape"]))
            numbers.append(number)
            number += 1
        param_groups.append({**group["hyperparameters"], "params": numbers})
    return {"state": state, "param_groups": param_groups}


def load_torch_optimizer_state(optimizer: ShardedOptimizer, state_dict: dict) -> None:
    """Load a plain torch optimizer's ``state_dict()`` (the same optimizer classes over the same param groups)
    into ``optimizer``: each rank takes its shard of every per-element state tensor, and the whole-parameter
    state of the parameters it owns whole. The master weights are taken from the model's current
    parameters, so load the matching model weights first. No communication: every rank checks the whole
    state dict, so that each raises the same error."""
    groups = describe_groups(optimizer)
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if saved_groups is None or [len(g["params"]) for g in saved_groups] != [len(g["members"]) for g in groups]:
        raise CheckpointError("the state dict's param groups do not match this optimizer's (same groups, same "
                              "parameters, in the same order, are needed)")
    number_of = {}  # trainable index -> torch's parameter number
    for group, saved in zip(groups, saved_groups):
        for member, number in zip(group["members"], saved["params"]):
            if member >= 0:
                number_of[member] = number
    saved_state = state_dict["state"]

    params = optimizer.trainable_params
    # which keys are per element: told by a parameter that is not a scalar (for a 0-dim parameter, Adam's
    # `step` and `exp_avg` have the same shape)
    per_element = {k for i, number in number_of.items() if params[i].dim() > 0
                   for k, v in (saved_state.get(number) or {}).items()
                   if torch.is_tensor(v) and v.shape == params[i].shape}

    def split(index: int):
        """Parameter ``index``'s saved state split (per element, flattened; scalars; whole), or Nones."""
        param, saved = params[index], plain_parts(saved_state.get(number_of[index]))
        require_logical_order(saved, param.shape, param.stride(), index)
        flat = {k: (flattened(v, param.stride()) if torch.is_tensor(v) and v.shape == param.shape
                    and (param.dim() > 0 or k in per_element) else v) for k, v in (saved or {}).items()}
        return split_state(flat, (param.numel(),), whole=True)

    buckets = optimizer.layout.buckets
    for index, slot in enumerate(optimizer.layout.slots):  # every parameter, whichever rank owns it
        whole = split(index)[2]
        if whole and not buckets[slot.bucket_index].whole and not buckets[slot.bucket_index].block:
            raise CheckpointError(f"the state of parameter {number_of[index]} holds whole-parameter tensors "
                                  f"({', '.join(whole)}), but this optimizer shards it flat; shard its group by "
                                  "whole parameters (per_parameter=[its class])")
    piece_states = []
    for piece, master, _ in optimizer.piece_states():
        elementwise, scalars, whole = split(piece.param_index)
        if elementwise is None:
            piece_states.append(None)
            continue
        window, block = slice(piece.param_start, piece.param_end), buckets[piece.bucket_index].block
        if block:  # a low-bit piece: the scales of its blocks, and the quantization map
            first, last = block_range(piece.param_start, piece.param_end, block)
            whole = {key: value[first:last].clone() if is_per_block(key) else value for key, value in whole.items()}
        piece_states.append(joined({**scalars, **whole, **{key: shaped(values[window].clone(), master.shape, master.stride())
                                                           for key, values in elementwise.items()}}, tuple(master.shape)))
    optimizer.restore_state(piece_states, saved_groups)
