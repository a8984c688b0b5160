"""Save and load a ShardedOptimizer (and its model) as a sharded checkpoint; convert to and from torch's format.

What a checkpoint holds (see :mod:`.files` for the directory and its crash safety):

* ``rank-NNNNN.pt`` per saving rank: ``pieces`` (K, 3) int64 rows ``(parameter index, start, end)`` -- the
  rank's ranges of the flattened parameters, in ``ShardLayout.pieces`` order -- and, concatenated in that
  order, ``master`` (the fp32 master weights; for fp32 models without offload, the parameters themselves)
  and ``state[key]`` for every per-element state tensor of the inner optimizer (``exp_avg``,
  ``momentum_buffer``, ...). Padding is never saved.
* ``index.pt``: the saved layout, every trainable parameter's shape, dtype and state-dict names, the param
  groups (hyperparameters and members), the optimizer class, the scalar state of every parameter (Adam's
  ``step``; ``None`` for a parameter not stepped yet), the fp16 loss-scaler state and the files' checksums.
  (Format 1 kept one scalar state per bucket; it still loads.)
* ``model-extras.pt``: the model's state that the optimizer does not hold (frozen parameters, buffers).

Any elementwise optimizer works: a state value is either per element (1-D, one entry per element of the
parameter's piece) or a scalar of the parameter; anything else is refused at save time.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import comm
from ..optimizer import ShardedOptimizer
from . import files
from .files import EXTRAS, INDEX, CheckpointError, rank_file
from .format import (FORMAT, READABLE_FORMATS, class_name, common_keys, copy_scalars, describe_groups,
                     merge_scalars, param_scalars, read_rank, saved_layout, split_state)
from .reshard import plan

# -- save ---------------------------------------------------------------------------------------------
def save_checkpoint(directory: str, optimizer: ShardedOptimizer, model: torch.nn.Module,
                    timeout: Optional[float] = None) -> None:
    """Save ``optimizer`` and ``model`` to ``directory``. Collective: call it on every rank of the optimizer's
    group, with a ``directory`` that every rank sees (a local disk for one machine, a shared one otherwise).

    ``timeout``: seconds each agreement between the ranks may wait, file writes on other ranks included
    (rank 0 alone writes the model's frozen parameters and buffers and the index), before raising
    ``CollectiveError`` (gloo); ``None``: the process group's timeout. Not the optimizer's
    ``collective_timeout``, which is sized for one collective, not for I/O.

    Each rank writes only its own shard; nothing is gathered. ``directory`` is replaced only once the new
    checkpoint is complete.
    """
    optimizer.sync_masters()  # parameters edited since the last step are what gets saved
    error: Optional[BaseException] = None
    entry = keys = None
    try:
        split = [(piece, master, *split_state(state, piece.length)) for piece, master, state in optimizer.piece_states()]
        keys = common_keys([elementwise for _, _, elementwise, _ in split if elementwise is not None])
        if optimizer.rank == 0:
            files.prepare_partial(directory)
    except Exception as caught:  # e.g. no permission: every rank must hear of it, not hang
        error = caught
    keys = common_keys([{key: None for key in k} for k in _agree(error, optimizer, timeout, "preparing the checkpoint directory", keys) if k])
    try:
        entry = files.write(_rank_payload(optimizer, split, keys), os.path.join(files.partial_path(directory),
                                                                                rank_file(optimizer.rank)))
        entry = (entry, {piece.param_index: scalars for piece, _, _, scalars in split})
    except Exception as caught:
        error = caught
    entries = _agree(error, optimizer, timeout, "writing the rank files", entry)
    try:
        if optimizer.rank == 0:
            partial = files.partial_path(directory)
            listing = {rank_file(rank): found for rank, (found, _) in enumerate(entries)}
            listing[EXTRAS] = files.write(_model_extras(optimizer, model), os.path.join(partial, EXTRAS))
            scalars = [merge_scalars([by_param[i] for _, by_param in entries if i in by_param])
                       for i in range(len(optimizer.trainable_params))]
            files.write(_index(optimizer, model, listing, keys, scalars), os.path.join(partial, INDEX))
            files.publish(directory)
    except Exception as caught:
        error = caught
    _agree(error, optimizer, timeout, "publishing the checkpoint")


def _rank_payload(optimizer: ShardedOptimizer, split: list, keys: list[str]) -> dict:
    """This rank's file: its pieces, their masters and their per-element state (zeros where not stepped)."""
    def gather(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().cpu() for t in tensors]) if tensors else torch.zeros(0)

    return {
        "format": FORMAT,
        "rank": optimizer.rank,
        "pieces": torch.tensor([(p.param_index, p.param_start, p.param_end) for p, _, _, _ in split],
                               dtype=torch.int64).reshape(-1, 3),
        "master": gather([master for _, master, _, _ in split]),
        "state": {key: gather([torch.zeros(p.length, dtype=m.dtype) if e is None else e[key] for p, m, e, _ in split])
                  for key in keys},
    }


def _param_names(optimizer: ShardedOptimizer, model: torch.nn.Module) -> list[list[str]]:
    """Every state-dict name of each trainable parameter (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    found = [names.get(id(p), []) for p in optimizer.trainable_params]
    if not all(found):
        raise CheckpointError("the optimizer holds a parameter that is not in the model's state_dict; pass the "
                              "model whose parameters the optimizer was built from")
    return found


def _model_extras(optimizer: ShardedOptimizer, model: torch.nn.Module) -> dict:
    """The model state the optimizer does not hold: frozen parameters and persistent buffers."""
    trainable = {id(p) for p in optimizer.trainable_params}
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict(keep_vars=True).items()
            if id(tensor) not in trainable}


def _index(optimizer: ShardedOptimizer, model: torch.nn.Module, listing: dict, keys: list[str],
           param_scalars: list[Optional[dict]]) -> dict:
    names = _param_names(optimizer, model)
    return {
        "format": FORMAT,
        "state_keys": keys,
        "world_size": optimizer.world_size,
        "stage": optimizer.stage,
        "offload": optimizer.offload is not None,
        "optimizer_class": class_name(type(optimizer.inner)),
        "layout": optimizer.layout.fingerprint(),
        "params": [{"shape": tuple(p.shape), "dtype": str(p.dtype), "names": n}
                   for p, n in zip(optimizer.trainable_params, names)],
        "groups": describe_groups(optimizer),
        "param_scalars": param_scalars,
        "loss_scaler": optimizer.loss_scaler.state_dict() if optimizer.loss_scaler else None,
        "files": listing,
    }


# -- load ---------------------------------------------------------------------------------------------
def load_checkpoint(directory: str, optimizer: ShardedOptimizer, model: torch.nn.Module,
                    timeout: Optional[float] = None) -> None:
    """Restore ``optimizer`` and ``model`` from a checkpoint saved at any world size, stage or offload setting.

    Collective: call it on every rank. Each rank reads only the files that hold part of its new shard. The
    master weights and optimizer state are restored exactly; the parameters are set from the master weights
    on every rank. Nothing is changed unless every rank has read and checked everything it needs.
    ``timeout``: as for :func:`save_checkpoint`.
    """
    error: Optional[BaseException] = None
    try:
        directory = files.resolve_directory(directory)
        index = files.read(directory, INDEX, None)
        _check_index(index, optimizer, model)
        extras = files.read(directory, EXTRAS, index["files"][EXTRAS])
        _check_extras(extras, model)
        restored = _read_shards(directory, index, optimizer)
    except Exception as caught:
        error = caught
    _agree(error, optimizer, timeout, "loading the checkpoint")

    masters, piece_states, hyperparameters = restored
    optimizer.zero_grad(set_to_none=True)
    optimizer.restore_state(piece_states, hyperparameters, masters, index["loss_scaler"])
    with torch.no_grad():
        state = model.state_dict()
        for name, tensor in extras.items():
            state[name].copy_(tensor)


def _check_index(index, optimizer: ShardedOptimizer, model: torch.nn.Module) -> None:
    if not isinstance(index, dict) or index.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"not a zeroimpl checkpoint (the index has no format tag {FORMAT!r})")
    if index["optimizer_class"] != class_name(type(optimizer.inner)):
        raise CheckpointError(f"the checkpoint holds {index['optimizer_class']} state; this optimizer runs "
                              f"{class_name(type(optimizer.inner))}")
    saved, names = index["params"], _param_names(optimizer, model)
    if len(saved) != len(optimizer.trainable_params):
        raise CheckpointError(f"the checkpoint has {len(saved)} trainable parameters, this model "
                              f"{len(optimizer.trainable_params)}: a checkpoint of another model")
    for i, (entry, param, name) in enumerate(zip(saved, optimizer.trainable_params, names)):
        if tuple(entry["shape"]) != tuple(param.shape) or entry["names"] != name:
            raise CheckpointError(f"trainable parameter {i} is {entry['names']} {tuple(entry['shape'])} in the "
                                  f"checkpoint but {name} {tuple(param.shape)} here: a checkpoint of another model")
    if [g["members"] for g in index["groups"]] != [g["members"] for g in describe_groups(optimizer)]:
        raise CheckpointError("the checkpoint's param groups hold other parameters than this optimizer's; "
                              "build the optimizer with the same param groups")
    if sorted(index["files"]) != sorted([rank_file(r) for r in range(index["world_size"])] + [EXTRAS]):
        raise CheckpointError("the checkpoint's index lists other files than its world size needs")


def _check_extras(extras: dict, model: torch.nn.Module) -> None:
    state = model.state_dict()
    for name, tensor in extras.items():
        if name not in state or tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"the checkpoint's model entry {name!r} {tuple(tensor.shape)} does not fit this "
                                  "model: a checkpoint of another model")


def _read_shards(directory: str, index: dict, optimizer: ShardedOptimizer):
    """Read this rank's new shard: (masters per bucket, the inner state per piece, hyperparameters)."""
    saved = saved_layout(index)
    layout, storages = optimizer.layout, optimizer.storages
    scalars = param_scalars(index, saved)
    keys = list(index["state_keys"])
    masters = [torch.zeros(s.master.numel(), dtype=s.master.dtype) for s in storages]
    states = [{key: torch.zeros(s.master.numel(), dtype=s.master.dtype) for key in keys} for s in storages]

    copies = plan(saved, layout, optimizer.rank)
    for source in sorted({c.source_rank for c in copies}):
        payload = read_rank(directory, index, saved, source, keys)
        for c in (c for c in copies if c.source_rank == source):
            src, dst = slice(c.source_offset, c.source_offset + c.length), slice(c.target_offset, c.target_offset + c.length)
            masters[c.target_bucket][dst] = payload["master"][src]
            for key in keys:
                states[c.target_bucket][key][dst] = payload["state"][key][src]

    piece_states = []
    for piece, _, _ in optimizer.piece_states():
        found = scalars[piece.param_index]
        window = slice(piece.shard_offset, piece.shard_offset + piece.length)
        piece_states.append(None if found is None else
                            {**copy_scalars(found), **{key: states[piece.bucket_index][key][window].clone() for key in keys}})
    return masters, piece_states, [g["hyperparameters"] for g in index["groups"]]


# -- collective error handling ---------------------------------------------------------------------
def _agree(error: Optional[BaseException], optimizer: ShardedOptimizer, timeout: Optional[float], what: str,
           value=None) -> list:
    """All-gather (error, value) so that a failure on one rank raises on every rank instead of a hang; the
    waits are bounded by ``timeout`` (``None``: the process group's)."""
    mine = (None if error is None else f"{type(error).__name__}: {error}", value)
    gathered = comm.all_gather_objects(mine, optimizer.process_group, timeout, f"checkpoint agreement ({what})")
    failures = [(rank, message) for rank, (message, _) in enumerate(gathered) if message is not None]
    if error is not None:
        raise error
    if failures:
        rank, message = failures[0]
        raise CheckpointError(f"rank {rank} failed while {what}: {message}")
    return [v for _, v in gathered]
