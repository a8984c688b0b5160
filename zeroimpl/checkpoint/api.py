"""Save and load a ShardedOptimizer (and its model) as a sharded checkpoint; convert to and from torch's format.

What a checkpoint holds (see :mod:`.files` for the directory and its crash safety):

* ``rank-NNNNN.pt`` per saving rank: ``pieces`` (K, 3) int64 rows ``(parameter index, start, end)`` -- the
  rank's ranges of the flattened parameters, in ``ShardLayout.pieces`` order -- and, concatenated in that
  order, ``master`` (the master weights, at least fp32; for fp32 and fp64 models without offload, the parameters
  themselves) and ``state[key]`` for every per-element state tensor of the inner optimizers (``exp_avg``,
  ``momentum_buffer``, ...), over the pieces whose parameter has that key; ``whole_state`` maps a
  parameter index to its whole-parameter state tensors (Adafactor's ``row_var``/``col_var``); with
  ``quantize_param_gather``, ``published``: the parameters as the last 8-bit all-gather left them (within a
  quantization step of the masters), which a load all-gathers exactly, so that training resumes bitwise.
  Padding is never saved.
* ``index.pt``: the saved layout, every trainable parameter's shape, dtype and state-dict names, the param
  groups (hyperparameters, members and optimizer class), the scalar state and per-element state keys of
  every parameter (``None`` for a parameter not stepped yet), the loss-scaler state and the files'
  checksums. (Formats 1 and 2 had one optimizer class and wrote every piece under every key; they load.)
* ``model-extras.pt``: the model's state that the optimizer does not hold (frozen parameters, buffers).

A state value is per element (one entry per element of the parameter's piece), a scalar of the parameter,
or -- for a parameter of a whole-parameter bucket -- any tensor of that parameter, which moves whole with it
to its new owner; or -- for a piece of a blocked bucket (a low-bit optimizer) -- its scales, one per
quantization block, which move with their blocks, and its quantization map (torchao's quantized state, kept
as tensor subclasses, is stored as such parts: :mod:`zeroimpl.state_format`); anything else is refused at save
time.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from ..memory_format import flattened
from ..optimizer import ShardedOptimizer
from ..state_format import CheckpointError, describe_groups, split_state
from ..topology import Topology
from . import files
from .files import EXTRAS, INDEX, rank_file
from .format import (FORMAT, check_fits, check_format, merge_scalars, model_state, optimizer_classes, param_names,
                     read_new_shard)


# -- save ---------------------------------------------------------------------------------------------
def save_checkpoint(directory: str, optimizer: ShardedOptimizer, model: torch.nn.Module,
                    timeout: Optional[float] = None, *, when: Optional[bool] = None) -> bool:
    """Save ``optimizer`` and ``model`` to ``directory``; return whether it saved. Call it on every rank of the
    optimizer's group.

    Args:
        directory: a folder every rank sees, or each rank's own; replaced once the new one is complete.
        optimizer: the :class:`ShardedOptimizer`.
        model: the model it trains.
        timeout: seconds each agreement between the ranks may wait (writes included), then ``CollectiveError``.
            ``None``: the process group's timeout.
        when: save if the first rank's value is true; ``None``: save.
    """
    _check_arguments(optimizer, model, "save_checkpoint")
    topology = optimizer.topology
    decided = when is None or bool(when)
    save = uuid.uuid4().hex[:16]  # (the first rank's names the save on every rank)
    writes = topology.replicate_rank == 0  # the other replicas hold the same shards
    optimizer.sync_masters()  # parameters edited since the last step are what gets saved
    error: Optional[BaseException] = None
    entry = None
    try:
        whole = [bucket.whole or bool(bucket.block) for bucket in optimizer.layout.buckets]
        split = [(piece, master, *split_state(state, tuple(master.shape), whole[piece.bucket_index], master.stride()))
                 for piece, master, state in optimizer.piece_states()]
        if topology.is_first and decided:
            files.prepare_partial(directory, save, optimizer.rank)
    except Exception as caught:  # e.g. no permission: every rank must hear of it, not hang
        error = caught
    decided, save = _agree(error, optimizer, timeout, "preparing the checkpoint directory", (decided, save))[0]
    if not decided:
        return False  # the first rank's decision (topology.all_gather_objects puts it first)
    try:
        if not topology.is_first and not files.prepared(directory, save):  # a directory of its own
            if not writes:
                raise CheckpointError(
                    f"this rank does not see the first rank's checkpoint directory {directory!r}, and with hybrid "
                    "sharding (a device mesh) only the first replica's ranks write theirs: the other replicas' "
                    "directories would stay empty, with nothing to load. Save to a directory every node sees")
            files.claim_partial(directory, save, optimizer.rank)
    except Exception as caught:
        error = caught
    _agree(error, optimizer, timeout, "preparing each rank's checkpoint directory")
    publishes = False
    try:
        if writes:  # (whether it publishes its directory is read before any rank may have published)
            publishes = files.leads(directory, save, optimizer.rank)
            entry = files.write(_rank_payload(optimizer, split, save),
                                os.path.join(files.partial_path(directory), rank_file(optimizer.rank)))
            entry = (entry, {piece.param_index: (scalars, None if elementwise is None else
                                                 {key: str(value.dtype) for key, value in elementwise.items()})
                             for piece, _, elementwise, scalars, _ in split})
    except Exception as caught:
        error = caught
    written = _agree(error, optimizer, timeout, "writing the rank files", (entry, publishes))
    entries = [entry for entry, _ in written][:topology.shard_size]
    # with directories of their own, the other ranks publish theirs once the index is written (its own agreement),
    # so that a save that fails before its index leaves every rank's earlier checkpoint in place
    separate = sum(publisher for _, publisher in written) > 1
    try:
        if topology.is_first:
            partial = files.partial_path(directory)
            listing = {rank_file(rank): found for rank, (found, _) in enumerate(entries)}
            listing[EXTRAS] = files.write(_model_extras(optimizer, model), os.path.join(partial, EXTRAS))
            held = [[by_param[i] for _, by_param in entries if i in by_param]
                    for i in range(len(optimizer.trainable_params))]
            scalars = [merge_scalars([found for found, _ in pieces]) for pieces in held]
            keys = [_same_keys([None if found is None else sorted(found) for _, found in pieces]) for pieces in held]
            # a key's arrays concatenate every piece's, promoted to a common dtype (bitsandbytes keeps uint8 state
            # for large parameters, fp32 for small ones under the same key): each parameter's own dtypes
            dtypes = [next((found for _, found in pieces if found is not None), None) for pieces in held]
            files.write(_index(optimizer, model, save, listing, keys, scalars, dtypes), os.path.join(partial, INDEX))
            if not separate:
                files.publish(directory, save)
    except Exception as caught:
        error = caught
    if separate:
        _agree(error, optimizer, timeout, "writing the index")
        try:
            if publishes:  # the rank that prepared its directory
                files.publish(directory, save)
        except Exception as caught:
            error = caught
    _agree(error, optimizer, timeout, "publishing the checkpoint")
    return True


def _same_keys(keys: list[Optional[list[str]]]) -> Optional[list[str]]:
    """One parameter's per-element state keys from the pieces that hold it, which must agree."""
    if any(k != keys[0] for k in keys):
        raise CheckpointError("the pieces of one parameter hold different optimizer state (stepped on some ranks "
                              "only, or other keys); the ranks have diverged")
    return keys[0]


def _rank_payload(optimizer: ShardedOptimizer, split: list, save: str) -> dict:
    """This rank's file of save ``save``: its pieces, their masters, per key the per-element state of the pieces
    that have it, and the whole-parameter state by parameter index."""
    def gather(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([flattened(t.detach(), t.stride()).cpu() for t in tensors]) if tensors else torch.zeros(0)

    keys = sorted({key for _, _, elementwise, _, _ in split for key in elementwise or ()})
    payload = {
        "format": FORMAT,
        "save": save,
        "rank": optimizer.rank,
        "pieces": torch.tensor([(p.param_index, p.param_start, p.param_end) for p, _, _, _, _ in split],
                               dtype=torch.int64).reshape(-1, 3),
        "master": gather([master for _, master, _, _, _ in split]),
        "state": {key: gather([e[key] for _, _, e, _, _ in split if e and key in e]) for key in keys},
        "whole_state": {p.param_index: w for p, _, _, _, w in split if w},
    }
    storages = optimizer.storages
    if any(s.published is not None for s in storages):  # a quantized all-gather: the parameters as published
        payload["published"] = gather([storages[p.bucket_index].published[p.shard_offset:p.shard_offset + p.length]
                                       for p, _, _, _, _ in split])
    return payload


def _model_extras(optimizer: ShardedOptimizer, model: torch.nn.Module) -> dict:
    """The model state the optimizer does not hold: frozen parameters and persistent buffers."""
    trainable = {id(p) for p in optimizer.trainable_params}
    return {name: tensor.detach().cpu().clone() for name, tensor in model_state(model, keep_vars=True).items()
            if id(tensor) not in trainable}


def _index(optimizer: ShardedOptimizer, model: torch.nn.Module, save: str, listing: dict,
           keys: list[Optional[list[str]]], param_scalars: list[Optional[dict]], dtypes: list[Optional[dict]]) -> dict:
    names = param_names(optimizer, model)
    return {
        "format": FORMAT,
        "save": save,
        "param_state_keys": keys,
        "param_state_dtypes": dtypes,
        "world_size": optimizer.world_size,
        "stage": optimizer.stage,
        "offload": optimizer.offload is not None,
        "optimizer_classes": optimizer_classes(optimizer),
        "layout": optimizer.layout.fingerprint(),
        "params": [{"shape": tuple(p.shape), "strides": tuple(p.stride()), "dtype": str(p.dtype), "names": n}
                   for p, n in zip(optimizer.trainable_params, names)],
        "groups": describe_groups(optimizer),
        "param_scalars": param_scalars,
        "loss_scaler": optimizer.loss_scaler.state_dict() if optimizer.loss_scaler else None,
        "files": listing,
    }


# -- load ---------------------------------------------------------------------------------------------
def exists_on_every_rank(directory: str, optimizer: ShardedOptimizer, timeout: Optional[float] = None) -> bool:
    """Whether every rank of ``optimizer`` sees ``directory`` (or what a save killed mid-publish left of it), the
    same answer on every rank. Collective; ``timeout`` as for :func:`save_checkpoint`."""
    return all(_ranks(optimizer, timeout).all_gather_objects(files.findable(directory), "checkpoint existence check"))


def _check_arguments(optimizer, model, function: str) -> None:
    """Refuse arguments in the wrong order or of the wrong kind (the same on every rank: no collective yet)."""
    if not isinstance(optimizer, ShardedOptimizer) or not isinstance(model, torch.nn.Module):
        raise TypeError(f"{function}(directory, optimizer, model) takes a ShardedOptimizer and then the model, got "
                        f"{type(optimizer).__name__} and {type(model).__name__}")


def load_checkpoint(directory: str, optimizer: ShardedOptimizer, model: torch.nn.Module,
                    timeout: Optional[float] = None, missing: Optional[str] = None) -> None:
    """Restore ``optimizer`` and ``model`` from a checkpoint of any world size, stage or offload, on every rank. A
    failure on one rank raises on all (a bad checkpoint: ``CheckpointError``), changing nothing.

    Args:
        directory: the folder given to :func:`save_checkpoint`.
        optimizer: the :class:`ShardedOptimizer`.
        model: the model it trains.
        timeout: as for :func:`save_checkpoint`.
        missing: if given, ``FileNotFoundError(missing)`` on every rank when some rank does not see ``directory``;
            ``None``: refused as unreadable.
    """
    _check_arguments(optimizer, model, "load_checkpoint")
    if missing is not None and not exists_on_every_rank(directory, optimizer, timeout):
        raise FileNotFoundError(missing)
    optimizer.sync_masters()  # (a model moved or converted before the first step is followed first)
    error: Optional[BaseException] = None
    index = extras = None
    try:
        own = files.resolve_directory(directory, index_needed=False)  # (this rank's own, or everyone's)
        if os.path.isfile(os.path.join(own, INDEX)):
            index = files.read(own, INDEX, None)
            check_format(index)
            extras = files.read(own, EXTRAS, index["files"][EXTRAS])
    except Exception as caught:
        error = caught
    holds = error is None and index is not None  # (a checked index: a dict of the format)
    found = _agree(error, optimizer, timeout, "finding the checkpoint", (holds, index.get("save") if holds else None))
    holders = [position for position, (has_index, _) in enumerate(found) if has_index]  # (all_gather_objects order)
    if not holders:
        raise CheckpointError(f"{directory!r} is not a complete checkpoint: no rank's directory holds its {INDEX}")
    saves = {str(save) for has_index, save in found if has_index}
    if len(saves) > 1:
        raise CheckpointError(f"the ranks' directories {directory!r} hold the indexes of different saves "
                              f"({', '.join(sorted(saves))}): give every rank the directory of one save")
    if len(holders) < len(found):  # a save to each rank's own directory: the index and extras from the first holder
        index, extras = _ranks(optimizer, timeout).broadcast_object(
            (index, extras), holders[0], "checkpoint agreement (sharing the checkpoint's index)")
    try:
        check_fits(index, extras, optimizer, model)
        restored = read_new_shard(own, index, optimizer)
    except Exception as caught:
        error = caught
    _agree(error, optimizer, timeout, "loading the checkpoint")

    masters, piece_states, hyperparameters, published = restored
    optimizer.zero_grad(set_to_none=True)
    optimizer.restore_state(piece_states, hyperparameters, masters, index["loss_scaler"], published)
    with torch.no_grad():
        state = model_state(model)
        for name, tensor in extras.items():
            state[name].copy_(tensor)


# -- collective error handling ---------------------------------------------------------------------
def _ranks(optimizer: ShardedOptimizer, timeout: Optional[float]) -> Topology:
    """The optimizer's ranks, whose collectives here wait at most the checkpoint's ``timeout``."""
    return replace(optimizer.topology, timeout=timeout)


def _agree(error: Optional[BaseException], optimizer: ShardedOptimizer, timeout: Optional[float], what: str,
           value=None) -> list:
    """All-gather (error, value) so that a failure on one rank raises on every rank instead of a hang; the
    waits are bounded by ``timeout`` (``None``: the process group's). A file system's error (``OSError``) raises
    as a ``CheckpointError`` with the same words on every rank, the failing one included; a ``CheckpointError``
    raises as it is on the rank that found it."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if isinstance(error, OSError):
        message += " (a file system error: check that this rank can create and write the directory, with room)"
    gathered = _ranks(optimizer, timeout).all_gather_objects((message, value, dist.get_rank()),
                                                             f"checkpoint agreement ({what})")
    failures = [(rank, message) for message, _, rank in gathered if message is not None]
    if error is not None and not isinstance(error, OSError):
        raise error
    if failures:
        rank, message = failures[0]
        raise CheckpointError(f"rank {rank} failed while {what}: {message}") from error
    return [v for _, v, _ in gathered]
