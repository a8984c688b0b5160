"""The files of a checkpoint directory: safe reading, durable writing, atomic publishing.

Every file is a ``torch.save`` archive read back with ``torch.load(weights_only=True)``: tensors, numbers,
strings and containers only, so a crafted file cannot run code. Each file's size and SHA-256 are recorded in
the index and checked before the file is used, so a truncated or altered file is refused, not half-loaded.

A save writes into ``<dir>.partial`` and publishes with renames, so an interrupted save never damages the
checkpoint it replaces::

    write rank files + extras -> fsync -> write index -> fsync -> [dir -> dir.previous] -> dir.partial -> dir
                                                                   -> delete dir.previous

Killed before the last rename, ``<dir>`` (or, between the two renames, ``<dir>.previous``) still holds the
previous checkpoint, and :func:`resolve_directory` finds it.

A rank's ``<dir>`` may be its own (a node-local disk, a per-worker temporary folder) or the one the first rank
writes (a shared filesystem); the save finds out which, with no option. The first rank prepares its
``<dir>.partial`` for the save (named by a save id) before the others look; each other writing rank that does
not find the save's marker there claims its own ``<dir>.partial`` (:func:`claim_partial`: the first rank to
create ``<dir>.claim-<save>`` on that filesystem prepares it), and the rank the marker names publishes it
(:func:`leads`). The first rank's directory alone holds the index and the model's extras; the union of the
directories is the whole checkpoint.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
from typing import Optional

import torch

from ..state_format import CheckpointError

INDEX = "index.pt"
EXTRAS = "model-extras.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def partial_path(directory: str) -> str:
    return directory.rstrip(os.sep) + ".partial"


def previous_path(directory: str) -> str:
    return directory.rstrip(os.sep) + ".previous"


def write(obj, path: str) -> dict:
    """``torch.save`` to ``path`` and flush it to disk; return its size and SHA-256 for the index."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256(path)}


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read(directory: str, name: str, expected: dict | None):
    """Load one file of the checkpoint with ``weights_only=True`` after checking it against the index entry
    ``expected`` (``None`` only for the index itself)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {directory!r} is incomplete: {name} is missing")
    if expected is not None:
        size = os.path.getsize(path)
        if size != expected["bytes"] or sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path} is corrupt ({size} bytes, the index recorded {expected['bytes']} and "
                                  "another checksum); restore it or load an earlier checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=expected is not None)
    except Exception as error:  # truncated archive, or objects other than tensors and containers
        raise CheckpointError(f"{path} cannot be read safely ({type(error).__name__}: {str(error)[:300]}); "
                              "checkpoint files hold only tensors, numbers, strings and containers") from error


def save_of(directory: str, name: str) -> Optional[str]:
    """The save that wrote the checkpoint file ``name`` (its ``"save"``), or None where it cannot be told."""
    try:
        return torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True, mmap=True)["save"]
    except Exception:  # noqa: BLE001 - unreadable, or written before saves were named: nothing to tell
        return None


def findable(directory: str) -> bool:
    """Whether :func:`resolve_directory` has a folder to look in: ``directory``, or the last complete checkpoint
    of a save killed between its two renames."""
    return os.path.isdir(directory) or os.path.isfile(os.path.join(previous_path(directory), INDEX))


def resolve_directory(directory: str, index_needed: bool = True) -> str:
    """The directory holding the last checkpoint published to ``directory`` (``index_needed=False``: also one that
    holds a part without the index, a rank's own directory of a node-local save)."""
    if os.path.isfile(os.path.join(directory, INDEX)):
        return directory
    previous = previous_path(directory)
    if not os.path.exists(directory) and os.path.isdir(previous) and (
            not index_needed or os.path.isfile(os.path.join(previous, INDEX))):
        return previous  # a save was killed between its two renames
    if os.path.isdir(directory):
        if not index_needed:
            return directory
        raise CheckpointError(f"{directory!r} is not a complete checkpoint: it has no {INDEX}")
    raise CheckpointError(f"no checkpoint at {directory!r}")


def prepare_partial(directory: str, save: str, rank: int) -> None:
    """Empty ``<dir>.partial`` (left over from a killed save, if any), create it, and mark it as save ``save``'s,
    published by ``rank``."""
    partial = partial_path(directory)
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with open(os.path.join(partial, _marker(save)), "w") as handle:
        handle.write(str(rank))


def prepared(directory: str, save: str) -> bool:
    """Whether ``<dir>.partial`` is prepared for save ``save`` (by the first rank, on a directory this rank shares
    with it, or by a rank that claimed it). Read through a listing of the folder, which a network file system
    revalidates, not a lookup it may answer from a cached miss."""
    try:
        return _marker(save) in os.listdir(partial_path(directory))
    except FileNotFoundError:
        return False


def claim_partial(directory: str, save: str, rank: int) -> None:
    """Prepare ``<dir>.partial`` for save ``save`` unless it is prepared already (a directory this rank shares with
    the first rank, or with a rank that claimed it first). Before any rank writes into it."""
    if prepared(directory, save):
        return
    claim = f"{directory.rstrip(os.sep)}.claim-{save}"
    os.makedirs(os.path.dirname(os.path.abspath(claim)), exist_ok=True)
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another rank on this filesystem prepares it
    try:
        prepare_partial(directory, save, rank)
    finally:
        os.remove(claim)


def leads(directory: str, save: str, rank: int) -> bool:
    """Whether ``rank`` publishes ``<dir>.partial`` of save ``save`` (the rank that prepared it last)."""
    with open(os.path.join(partial_path(directory), _marker(save))) as handle:
        return handle.read() == str(rank)


def _marker(save: str) -> str:
    return f"save-{save}"


def publish(directory: str, save: str) -> None:
    """Make ``<dir>.partial`` of save ``save`` the checkpoint at ``<dir>``, replacing any earlier one (its marker
    removed first: the directories of one save merge without a conflict), and remove the claims that ranks killed
    while claiming ``<dir>.partial`` left (every claim of this save is settled before any rank writes)."""
    partial, previous = partial_path(directory), previous_path(directory)
    os.remove(os.path.join(partial, _marker(save)))
    _fsync_directory(partial)
    if not os.path.exists(directory) and os.path.exists(previous):
        os.rename(previous, directory)  # an earlier save died between its renames: put its checkpoint back
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(directory):
        os.rename(directory, previous)
    os.rename(partial, directory)
    _fsync_directory(os.path.dirname(os.path.abspath(directory)))
    shutil.rmtree(previous, ignore_errors=True)
    for stale in glob.glob(glob.escape(directory.rstrip(os.sep)) + ".claim-*"):  # a rank killed while it claimed
        os.remove(stale)


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
