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
    scalars_of = param_scalars(index)
    chosen = range(len(index["groups"])) if groups is None else list(groups)
    if not all(isinstance(g, int) and 0 <= g < len(index["groups"]) for g in chosen):
        raise ValueError(f"groups must be positions of the checkpoint's {len(index['groups'])} param groups, "
                         f"got {groups!r}")
    entries = index["params"]
    return torch_optimizer_state([index["groups"][g] for g in chosen], [entry["shape"] for entry in entries],
                                 [saved_memory_order(entry) for entry in entries], states, scalars_of)


def load_torch_optimizer_state(optimizer: ShardedOptimizer, state_dict: dict) -> None:
    """Load a plain torch optimizer's ``state_dict()`` (the same optimizer classes over the same param groups)
    into ``optimizer``: each rank takes its shard of every per-element state tensor, and the whole-parameter
    state of the parameters it owns whole. The master weights are taken from the model's current
    parameters, so load the matching model weights first. No communication: every rank checks the whole
    state dict, so that each raises the same error (``optimizer.load_state_dict`` of such a state does the same,
    agreed across the ranks)."""
    pieces = [(piece, master) for piece, master, _ in optimizer.piece_states()]
    optimizer.restore_state(*pieces_of_torch_state(state_dict, describe_groups(optimizer), optimizer.trainable_params,
                                                   optimizer.layout, pieces))
