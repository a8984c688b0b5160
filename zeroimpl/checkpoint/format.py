"""The checkpoint's file format: its version tags, the helpers that read and describe what it holds, the names of a
model's state, and the two parts of a load that depend on the format: whether a checkpoint fits an optimizer and a
model (:func:`check_fits`), and this rank's new shard read from the saved ones (:func:`read_new_shard`, by the
copies of :func:`plan`).

Shared by :mod:`.api` (save / load across ranks, which runs these on every rank and agrees on the outcome),
:mod:`.convert` (to and from torch's formats, in one process) and :mod:`.dcp`. See :mod:`.api` for what each file
holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import ShardLayout, overlap
from ..memory_format import contiguous_strides, same_order, shaped
from ..optimizer import ShardedOptimizer
from ..state_format import CheckpointError, block_range, describe_groups, is_per_block, joined, require_logical_order
from . import files
from .files import EXTRAS, rank_file

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


# -- the model's names -------------------------------------------------------------------------------
_UNCOMPILED = re.compile(r"(^|\.)_orig_mod\.")  # torch.compile's OptimizedModule in a state-dict name


def model_state(model: torch.nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the names of the model itself, also when ``torch.compile`` wrapped it (whose
    state dict prefixes every name with ``_orig_mod.``): a compiled model and the model are one checkpoint."""
    return {_UNCOMPILED.sub(r"\1", name): tensor for name, tensor in model.state_dict(keep_vars=keep_vars).items()}


def param_names(optimizer: ShardedOptimizer, model: torch.nn.Module) -> list[list[str]]:
    """Every state-dict name of each trainable parameter (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model_state(model, keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    found = [names.get(id(p), []) for p in optimizer.trainable_params]
    if not all(found):
        raise CheckpointError("the optimizer holds a parameter that is not in the model's state_dict; pass the "
                              "model whose parameters the optimizer was built from")
    return found


# -- resharding: which saved ranges fill which ranges of a new shard (integers only) ------------------
# A *piece* is a range ``[start, end)`` of one flattened parameter. A saving rank writes the pieces it owns
# (``ShardLayout.pieces(rank)``), concatenated in that order, into its file; so an element of a saved file is
# addressed by ``(saved rank, offset in the file's data)``. Loading under another layout -- another world
# size, bucket size or alignment -- intersects each piece the new rank owns with the saved pieces of the
# same parameter.


@dataclass(frozen=True)
class Copy:
    """Copy ``length`` elements from offset ``source_offset`` of saved rank ``source_rank``'s data (element
    ``piece_offset`` of its piece number ``source_piece``) to offset ``target_offset`` of the new rank's shard
    of bucket ``target_bucket`` (element ``target_piece_offset`` of its piece number ``target_piece``)."""

    source_rank: int
    source_offset: int
    target_bucket: int
    target_offset: int
    length: int
    source_piece: int = 0
    piece_offset: int = 0
    target_piece: int = 0
    target_piece_offset: int = 0


def saved_pieces(layout: ShardLayout) -> dict[int, list[tuple[int, int, int, int, int]]]:
    """For every parameter, its saved pieces ``(start, end, rank, file offset, piece number)``, by ``start``."""
    by_param: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for rank in range(layout.world_size):
        offset = 0
        for number, piece in enumerate(layout.pieces(rank)):
            by_param.setdefault(piece.param_index, []).append((piece.param_start, piece.param_end, rank, offset,
                                                               number))
            offset += piece.length
    for pieces in by_param.values():
        pieces.sort()
    return by_param


def plan(saved: ShardLayout, new: ShardLayout, rank: int) -> list[Copy]:
    """The copies that fill ``rank``'s shard under ``new`` from a checkpoint saved under ``saved``.

    Both layouts must describe the same parameters (same count and sizes). Every element of the new shard
    that belongs to a parameter is covered exactly once; padding is not.
    """
    sources = saved_pieces(saved)
    copies = []
    for target_number, piece in enumerate(new.pieces(rank)):
        for start, end, source_rank, file_offset, source_number in sources[piece.param_index]:
            common = overlap(start, end, piece.param_start, piece.param_end)
            if common:
                low, high = common
                copies.append(Copy(source_rank, file_offset + low - start, piece.bucket_index,
                                   piece.shard_offset + low - piece.param_start, high - low, source_number,
                                   low - start, target_number, low - piece.param_start))
    return copies


# -- loading: does it fit, and this rank's new shard ---------------------------------------------------
def check_fits(index: dict, extras: dict, optimizer: ShardedOptimizer, model: torch.nn.Module) -> None:
    """Refuse (``CheckpointError``) a checkpoint whose index (its format checked when read) or model extras do not
    fit this optimizer and model: other optimizer classes, parameters, shapes, memory formats, groups or files."""
    if group_classes(index) != optimizer_classes(optimizer):
        raise CheckpointError(f"the checkpoint's param groups step with {group_classes(index)}; this optimizer's "
                              f"with {optimizer_classes(optimizer)}: build the optimizer with the same optimizer "
                              "classes")
    saved, names = index["params"], param_names(optimizer, model)
    if len(saved) != len(optimizer.trainable_params):
        raise CheckpointError(f"the checkpoint has {len(saved)} trainable parameters, this model "
                              f"{len(optimizer.trainable_params)}: a checkpoint of another model")
    for i, (entry, param, name) in enumerate(zip(saved, optimizer.trainable_params, names)):
        if tuple(entry["shape"]) != tuple(param.shape) or entry["names"] != name:
            raise CheckpointError(f"trainable parameter {i} is {entry['names']} {tuple(entry['shape'])} in the "
                                  f"checkpoint but {name} {tuple(param.shape)} here: a checkpoint of another model")
        saved_strides = saved_memory_order(entry)
        if not same_order(param.shape, saved_strides, param.stride()):
            raise CheckpointError(f"trainable parameter {i} ({name}) was saved in the memory format of strides "
                                  f"{saved_strides}, but has strides {tuple(param.stride())} here: convert the model "
                                  "as it was when saved (e.g. model.to(memory_format=torch.channels_last)) before "
                                  "building the optimizer; a checkpoint that records no strides (written before "
                                  "zeroimpl kept memory formats) holds every parameter contiguous: "
                                  "p.data = p.data.contiguous() first")
    trainable = [[[m for m in g["members"] if m >= 0] for g in groups]  # (frozen members hold no state)
                 for groups in (index["groups"], describe_groups(optimizer))]
    if trainable[0] != trainable[1]:
        raise CheckpointError("the checkpoint's param groups hold other parameters than this optimizer's; "
                              "build the optimizer with the same param groups")
    if sorted(index["files"]) != sorted([rank_file(r) for r in range(index["world_size"])] + [EXTRAS]):
        raise CheckpointError("the checkpoint's index lists other files than its world size needs")
    _check_extras(extras, model)


def optimizer_classes(optimizer: ShardedOptimizer) -> list[str]:
    """Each param group's optimizer class name, as the index records it."""
    return [class_name(group["optimizer"]) for group in optimizer.param_groups]


def _check_extras(extras: dict, model: torch.nn.Module) -> None:
    """Every entry of the model extras names an entry of this model's state of its shape."""
    state = model_state(model)
    for name, tensor in extras.items():
        if name not in state or tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"the checkpoint's model entry {name!r} {tuple(tensor.shape)} does not fit this "
                                  "model: a checkpoint of another model")


def read_new_shard(directory: str, index: dict, optimizer: ShardedOptimizer):
    """Read this rank's new shard: (masters per bucket, the inner state per piece, hyperparameters, and per bucket
    the parameters as published where every file read holds them, else None)."""
    saved = saved_layout(index)
    scalars, keys_of, dtypes_of = param_scalars(index), file_keys(index), state_dtypes(index)
    masters = [torch.zeros(s.master.numel(), dtype=s.master.dtype) for s in optimizer.storages]
    published = [torch.zeros(s.shard.numel(), dtype=s.shard.dtype) for s in optimizer.storages]
    has_published = True  # every file read holds the parameters as published (saved with a quantized all-gather)
    targets = optimizer.piece_states()
    arrays: list[dict[str, torch.Tensor]] = [{} for _ in targets]  # per new piece: per-element state by key
    whole: list[dict] = [{} for _ in targets]  # per new piece: whole-parameter state

    copies = plan(saved, optimizer.layout, optimizer.rank)
    for source in sorted({c.source_rank for c in copies}):
        payload = read_rank(directory, index, saved, source, keys_of)
        source_pieces = saved.pieces(source)
        has_published &= "published" in payload
        offsets = key_offsets(source_pieces, keys_of)
        for c in (c for c in copies if c.source_rank == source):
            src = slice(c.source_offset, c.source_offset + c.length)
            dst = slice(c.target_offset, c.target_offset + c.length)
            masters[c.target_bucket][dst] = payload["master"][src]
            if has_published:
                published[c.target_bucket][dst] = payload["published"][src]
            piece, master, _ = targets[c.target_piece]
            for key in keys_of[piece.param_index]:
                start = offsets[key][c.source_piece] + c.piece_offset
                values = payload["state"][key]
                dtype = dtypes_of[piece.param_index].get(key, values.dtype)
                array = arrays[c.target_piece].setdefault(key, torch.zeros(piece.length, dtype=dtype))
                array[c.target_piece_offset:c.target_piece_offset + c.length] = values[start:start + c.length]
            found = payload["whole_state"].get(piece.param_index)
            saved_bucket = saved.buckets[saved.slots[piece.param_index].bucket_index]
            saved_block = saved_bucket.block
            if optimizer.layout.buckets[piece.bucket_index].whole and not saved_bucket.whole:
                # saved from flat shards (blocks of the memory order), stepped whole (of the logical order); the
                # scalars hold the recipes of torchao's state
                require_logical_order(scalars[piece.param_index], tuple(master.shape), master.stride(),
                                      piece.param_index)
            if found and saved_block:
                _copy_blocks(found, saved_block, optimizer.layout.buckets[piece.bucket_index],
                             source_pieces[c.source_piece].param_start + c.piece_offset, c.length,
                             source_pieces[c.source_piece].param_start, piece, whole[c.target_piece])
            elif found:
                if not optimizer.layout.buckets[piece.bucket_index].whole:
                    raise CheckpointError(f"trainable parameter {piece.param_index} has whole-parameter optimizer "
                                          f"state ({', '.join(found)}), but this optimizer shards it flat; shard its "
                                          "group by whole parameters, as when it was saved")
                whole[c.target_piece] = found

    piece_states = []
    for (piece, master, _), by_key, whole_state in zip(targets, arrays, whole):
        found = scalars[piece.param_index]
        piece_states.append(None if found is None else joined(
            {**copy_scalars(found),
             **{key: shaped(array, master.shape, master.stride()) for key, array in by_key.items()},
             **{key: value.clone() for key, value in whole_state.items()}}, tuple(master.shape)))
    return masters, piece_states, [g["hyperparameters"] for g in index["groups"]], published if has_published else None


def _copy_blocks(found: dict, block: int, target, start: int, length: int, source_start: int, piece,
                 into: dict) -> None:
    """Copy the low-bit state of elements ``[start, start + length)`` of a parameter (saved in a piece from
    ``source_start``, ``found``) into a new piece's (``into``, of bucket ``target``): the scales of the blocks
    they span, and the quantization map, the same in every piece. Both layouts must cut the parameter on the
    same blocks; a whole-parameter piece is cut on any, counted from the parameter's first element as the
    optimizer class counts them (a flat checkpoint loaded with ``per_parameter``, or one of bitsandbytes'
    LAMB/LARS saved before they were stepped whole)."""
    target_block = target.block or (block if target.whole else 0)
    if target_block != block:
        laid_out = f"in blocks of {target_block}" if target_block else "without blocks"
        raise CheckpointError(f"parameter {piece.param_index}'s optimizer state is quantized in blocks of {block}, "
                              f"but this optimizer lays it out {laid_out}; load it into the low-bit optimizer class "
                              "it was saved with")
    first, last = block_range(start, start + length, block)
    source_first, target_first = block_range(source_start, source_start, block)[0], block_range(
        piece.param_start, piece.param_start, block)[0]
    for key, value in found.items():
        if not is_per_block(key):
            into.setdefault(key, value)
            continue
        blocks = into.setdefault(key, torch.zeros(-(-piece.length // block), dtype=value.dtype))
        blocks[first - target_first:last - target_first] = value[first - source_first:last - source_first]
