"""Between sharded checkpoints and torch's own formats, in one process: :func:`export_fp32_state_dict` (as
DeepSpeed's ``zero_to_fp32``), :func:`consolidated_optimizer_state_dict` and the reverse,
:func:`load_torch_optimizer_state`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..memory_format import shaped
from ..optimizer import ShardedOptimizer
from ..state_format import (describe_groups, pieces_of_torch_state, place_piece,
                            torch_optimizer_state)
from . import files
from .files import EXTRAS, INDEX
from .format import (check_format, file_keys, key_offsets, param_scalars, read_rank, saved_layout,
                     saved_memory_order, state_dtypes)


def _read_full(directory: str):
    """(directory, index, saved layout, full flat masters per parameter, per parameter its full per-element
    state by key (flat) and its whole-parameter state by key)."""
    directory = files.resolve_directory(directory)
    index = files.read(directory, INDEX, None)
    check_format(index)
    layout = saved_layout(index)
    numels = [slot.numel for slot in layout.slots]
    keys_of, dtypes_of = file_keys(index), state_dtypes(index)
    masters = [None] * len(numels)
    states: list[dict[str, torch.Tensor]] = [{} for _ in numels]
    for rank in range(layout.world_size):
        payload = read_rank(directory, index, layout, rank, keys_of)
        pieces = layout.pieces(rank)
        offsets, offset = key_offsets(pieces, keys_of), 0
        for number, piece in enumerate(pieces):
            i = piece.param_index
            if masters[i] is None:
                masters[i] = torch.empty(numels[i], dtype=payload["master"].dtype)
            masters[i][piece.param_start:piece.param_end] = payload["master"][offset:offset + piece.length]
            per_element = {key: payload["state"][key][offsets[key][number]:offsets[key][number] + piece.length]
                           for key in keys_of[i]}
            place_piece(states[i], numels[i], piece, per_element, payload["whole_state"].get(i, {}),
                        layout.buckets[piece.bucket_index].block, dtypes_of[i])
            offset += piece.length
    return directory, index, layout, masters, states


def export_fp32_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """The model's full fp32 state dict, for ``model.load_state_dict``: trainable parameters from the masters (tied
    names share a tensor), the rest as saved, floating ones in fp32. No process group needed."""
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
    """The saved optimizer state as the plain inner optimizer's ``state_dict()`` over the same param groups, frozen
    members included. No process group needed. ``groups``: these groups' positions only, as an optimizer over them
    alone holds them (one call per optimizer class); ``None``: all."""
    _, index, layout, _, states = _read_full(directory)
    scalars_of = param_scalars(index)
    chosen = range(len(index["groups"])) if groups is None else list(groups)
    if not all(isinstance(g, int) and 0 <= g < len(index["groups"]) for g in chosen):
        raise ValueError(f"groups must be positions of the checkpoint's {len(index['groups'])} param groups, "
                         f"got {groups!r}")
    entries = index["params"]
    return torch_optimizer_state([index["groups"][g] for g in chosen], [entry["shape"] for entry in entries],
                                 [saved_memory_order(entry) for entry in entries], states, scalars_of)


def load_torch_optimizer_state(optimizer: ShardedOptimizer, state_dict: dict) -> None:
    """Load a plain torch optimizer's ``state_dict()`` (same classes and param groups) into ``optimizer``, on every
    rank, after the model's weights (the masters come from them). No communication: all ranks raise alike."""
    pieces = [(piece, master) for piece, master, _ in optimizer.piece_states()]
    optimizer.restore_state(*pieces_of_torch_state(state_dict, describe_groups(optimizer), optimizer.trainable_params,
                                                   optimizer.layout, pieces))
