"""The checkpoint's file format: its version tags and the helpers that read and describe what it holds.

Shared by :mod:`.api` (save / load across ranks) and :mod:`.convert` (to and from torch's formats, in one
process). See :mod:`.api` for what each file holds.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..layout import ShardLayout
from ..memory_format import contiguous_strides
from ..state_format import CheckpointError
from . import files
from .files import rank_file

FORMAT_NAME, FORMAT_VERSION = "zeroimpl.checkpoint", 4  # the only version read: 1 to 3 predate 0.1.0
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"


def check_format(index) -> None:
    """Refuse an index that is not a zeroimpl checkpoint of :data:`FORMAT`, naming what it is."""
    tag = index.get("format") if isinstance(index, dict) else None
    name, _, version = tag.rpartition("/") if isinstance(tag, str) else ("", "", "")
    if name == FORMAT_NAME and version.isdigit() and int(version) > FORMAT_VERSION:
        raise CheckpointError(f"this checkpoint has the format {tag!r}, written by a newer zeroimpl; this one reads "
                              f"{FORMAT!r}: upgrade zeroimpl to load it")
    if name == FORMAT_NAME and version.isdigit() and int(version) < FORMAT_VERSION:
        raise CheckpointError(f"this checkpoint has the format {tag!r}, of a development version before 0.1.0; "
                              f"this zeroimpl reads {FORMAT!r}: with the version that wrote it, convert it to a torch "
                              "optimizer state (zeroimpl.checkpoint.consolidated_optimizer_state_dict), and load "
                              "that with zeroimpl.checkpoint.load_torch_optimizer_state")
    if tag != FORMAT:
        raise CheckpointError(f"not a zeroimpl checkpoint (the index has no format tag {FORMAT!r})")


def file_keys(index: dict) -> list[tuple[str, ...]]:
    """By parameter index, the per-element state keys whose arrays in the rank files hold that parameter's
    pieces: only the keys of its state (none if never stepped)."""
    return [tuple(keys or ()) for keys in index["param_state_keys"]]


def key_offsets(pieces: list, keys_of_param: list[tuple[str, ...]]) -> dict[str, list[Optional[int]]]:
    """For one rank file: per key, each piece's offset in that key's array (``None``: not in it)."""
    offsets: dict[str, list[Optional[int]]] = {}
    filled: dict[str, int] = {}
    for position, piece in enumerate(pieces):
        for key in keys_of_param[piece.param_index]:
            offsets.setdefault(key, [None] * len(pieces))[position] = filled.get(key, 0)
            filled[key] = filled.get(key, 0) + piece.length
    return offsets


def class_name(cls: type) -> str:
    """``module.QualName`` of an optimizer class, as the index records it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def saved_layout(index: dict) -> ShardLayout:
    """The layout the checkpoint was saved with, checked against its world size."""
    try:
        layout = ShardLayout.from_fingerprint(index["layout"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise CheckpointError(f"the checkpoint's layout description is damaged ({error})") from error
    if layout.world_size != index["world_size"]:
        raise CheckpointError("the checkpoint's layout does not match its world size")
    return layout


def state_dtypes(index: dict) -> list[dict[str, torch.dtype]]:
    """By parameter index, the dtype of each of its per-element state tensors as saved (its key's array in a rank
    file is promoted to a dtype common to every piece under that key); empty for a parameter never stepped."""
    return [{key: getattr(torch, name.removeprefix("torch.")) for key, name in (found or {}).items()}
            for found in index["param_state_dtypes"]]


def param_scalars(index: dict) -> list[Optional[dict]]:
    """The scalar state of every trainable parameter (``None``: never stepped)."""
    return index["param_scalars"]


def merge_scalars(values: list[Optional[dict]]) -> Optional[dict]:
    """One parameter's scalar state from the pieces that hold it, which must agree (``None``: never stepped)."""
    if all(v is None for v in values):
        return None
    first = values[0]
    if any(v is None or v.keys() != first.keys() or any(not _same(v[k], first[k]) for k in v) for v in values):
        raise CheckpointError("the pieces of one parameter hold different scalar optimizer state (e.g. Adam's step "
                              "count); the ranks have diverged")
    return copy_scalars(first)


def copy_scalars(scalars: dict) -> dict:
    """A copy that shares no tensor with ``scalars``."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()}


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return torch.equal(a, b)
    return a == b


def group_classes(index: dict) -> list[str]:
    """Each param group's optimizer class name."""
    return index["optimizer_classes"]


def read_rank(directory: str, index: dict, layout: ShardLayout, rank: int,
              keys_of_param: list[tuple[str, ...]]) -> dict:
    """One saved rank's file, checked against the index and the saved layout."""
    name = rank_file(rank)
    if not os.path.isfile(os.path.join(directory, name)):
        raise CheckpointError(f"checkpoint {directory!r} is incomplete: {name} is missing (a checkpoint saved to each "
                              "rank's own directory loads at another world size or layout only from their union: "
                              "merge the ranks' directories into one)")
    try:
        payload = files.read(directory, name, index["files"][name])
    except CheckpointError as refused:
        written_by = files.save_of(directory, name)
        if written_by is None or written_by == index.get("save"):
            raise
        raise CheckpointError(f"{name} in {directory!r} belongs to save {written_by}, but the checkpoint's index to "
                              f"save {index.get('save')}: the directories hold files of two saves (a rank that "
                              "did not publish its part of the last save, or parts merged from two saves); load "
                              "one whole save") from refused
    pieces = layout.pieces(rank)
    expected = torch.tensor([(p.param_index, p.param_start, p.param_end) for p in pieces],
                            dtype=torch.int64).reshape(-1, 3)
    lengths = {key: 0 for piece in pieces for key in keys_of_param[piece.param_index]}
    for piece in pieces:
        for key in keys_of_param[piece.param_index]:
            lengths[key] += piece.length
    if (not isinstance(payload, dict) or payload.get("rank") != rank or not torch.equal(payload["pieces"], expected)
            or payload["master"].numel() != sum(p.length for p in pieces)
            or {key: t.numel() for key, t in payload["state"].items() if t.numel() or key in lengths} != lengths):
        raise CheckpointError(f"{rank_file(rank)} in {directory!r} does not match the checkpoint's index")
    return payload


def saved_memory_order(entry: dict) -> tuple:
    """The strides a checkpoint's parameter entry was saved with (contiguous before they were recorded)."""
    return tuple(entry["strides"]) if "strides" in entry else contiguous_strides(entry["shape"])
