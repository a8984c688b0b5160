"""Checkpoints saved to each rank's own directory: node-local disks, or a worker's temporary folder that an engine
(Ray Train) uploads and merges (issue 55).

Two ranks (gloo) train the small GPT-2 of tests/workloads.py with stage 2 and AdamW on one global batch, each rank
saving into a folder of its own, which the other rank never sees. Then:

* each rank's directory holds its published part: rank 0's the index, the model's extras and its rank file, rank
  1's its rank file alone; no ``.partial`` folder, claim or marker is left;
* resumed at the same world size, each rank from its own directory with no merge: bitwise the uninterrupted run;
* the two directories merged by copying, as an engine or an uploader merges them, load at world size 1 (another
  layout: a reshard) with the parameters exactly as saved;
* rank 1's file missing from its directory, or replaced by its file of an earlier save, is refused on every rank,
  naming the file (and both saves);
* a save that fails before its index is written (rank 0's disk full, simulated by its index writer raising
  ENOSPC) raises on every rank, and every rank's earlier checkpoint still loads, as saved;
* a failing rank raises a ``CheckpointError`` saying what it was doing, as the others do, never its file system's bare
  ``OSError``: rank 1's directory under a plain file (``NotADirectoryError``), rank 0's disk full;
* a ``<dir>.claim-<save>`` left by a rank killed while it claimed its directory is removed by the next save.
"""

import errno
import os
import shutil

import pytest
import torch

from distributed import run_distributed
from workloads import build_model, param_groups, train_on_global_batch
from zeroimpl import ShardedOptimizer
from zeroimpl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

SAVE_AT, STEPS = 3, 5


def _make():
    model = build_model("gpt2", torch.float32)
    return model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _own(root: str, rank: int, name: str = "") -> str:
    """Rank ``rank``'s own folder (or ``name`` in it): no other rank looks there."""
    return os.path.join(root, f"rank{rank}", name)


def _node_local(rank, world_size, root):
    os.makedirs(_own(root, rank), exist_ok=True)
    if rank == 1:  # a claim of a save killed while rank 1 claimed its directory
        open(_own(root, rank, "checkpoint.claim-0123456789abcdef"), "w").close()
    model, optimizer = _make()
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT - 1))
    save_checkpoint(_own(root, rank, "earlier"), optimizer, model)
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT - 1, SAVE_AT))
    save_checkpoint(_own(root, rank, "checkpoint"), optimizer, model)
    at_save = _params(model)
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    out = {"at_save": at_save, "uninterrupted": _params(model), "folder": sorted(os.listdir(_own(root, rank))),
           "checkpoint": sorted(os.listdir(_own(root, rank, "checkpoint")))}

    model, optimizer = _make()
    load_checkpoint(_own(root, rank, "checkpoint"), optimizer, model)
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    out["resumed"] = _params(model)

    out["refused"] = {}
    for how in ("missing", "earlier save"):
        copy = _own(root, rank, how.replace(" ", "-"))
        shutil.copytree(_own(root, rank, "checkpoint"), copy)
        if rank == 1:
            os.remove(os.path.join(copy, "rank-00001.pt"))
            if how == "earlier save":
                shutil.copy(_own(root, 1, os.path.join("earlier", "rank-00001.pt")), copy)
        torch.distributed.barrier()
        model, optimizer = _make()
        before = _params(model)
        try:
            load_checkpoint(copy, optimizer, model)
            out["refused"][how] = None
        except CheckpointError as error:
            out["refused"][how] = str(error)
        out["refused"][how + " unchanged"] = all(torch.equal(p, before[n]) for n, p in _params(model).items())

    blocked = _own(root, rank, "blocked")
    open(blocked, "w").close()  # a plain file where rank 1's directory's parent should be
    try:
        save_checkpoint(os.path.join(blocked, "checkpoint") if rank == 1 else _own(root, rank, "elsewhere"),
                        optimizer, model)
        out["unwritable"] = None
    except Exception as error:  # noqa: BLE001 - which kind is what the test checks
        out["unwritable"] = f"{type(error).__name__}: {error}"

    import zeroimpl.checkpoint.api as checkpoint_api

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")
    index_writer = checkpoint_api._index
    if rank == 0:
        checkpoint_api._index = disk_full
    try:
        save_checkpoint(_own(root, rank, "checkpoint"), optimizer, model)
        out["failed save"] = None
    except Exception as error:  # noqa: BLE001 - which kind is what the test checks
        out["failed save"] = f"{type(error).__name__}: {error}"
    finally:
        checkpoint_api._index = index_writer
    model, optimizer = _make()
    load_checkpoint(_own(root, rank, "checkpoint"), optimizer, model)
    out["after the failed save"] = _params(model)
    return out


def _merged_at_world_size_1(rank, world_size, merged):
    model, optimizer = _make()
    load_checkpoint(merged, optimizer, model)
    return _params(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("node-local"))
    saved = run_distributed(2, _node_local, root)
    merged = os.path.join(root, "merged")
    for rank in range(2):  # as an engine merges its workers' uploads: every file of every rank into one folder
        shutil.copytree(_own(root, rank, "checkpoint"), merged, dirs_exist_ok=True)
    return saved, run_distributed(1, _merged_at_world_size_1, merged)[0]


def test_each_rank_publishes_its_part_in_its_own_directory(runs):
    saved, _ = runs
    assert saved[0]["checkpoint"] == ["index.pt", "model-extras.pt", "rank-00000.pt"]
    assert saved[1]["checkpoint"] == ["rank-00001.pt"]
    for rank in range(2):
        assert saved[rank]["folder"] == ["checkpoint", "earlier"]  # (nothing partial, no claim, not even a stale one)


def test_each_rank_resumes_from_its_own_directory_bitwise(runs):
    saved, _ = runs
    for rank in range(2):
        resumed, uninterrupted = saved[rank]["resumed"], saved[rank]["uninterrupted"]
        assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


def test_the_merged_directories_load_at_another_world_size(runs):
    saved, merged = runs
    assert all(torch.equal(merged[n], p) for n, p in saved[0]["at_save"].items())


def test_a_save_that_fails_before_its_index_keeps_every_ranks_earlier_checkpoint(runs):
    saved, _ = runs
    for rank in range(2):
        assert saved[rank]["failed save"].startswith("CheckpointError: ")
        assert "No space left on device" in saved[rank]["failed save"]
        loaded = saved[rank]["after the failed save"]
        assert all(torch.equal(loaded[n], p) for n, p in saved[rank]["at_save"].items())


def test_a_missing_or_foreign_part_is_refused_on_every_rank(runs):
    saved, _ = runs
    for rank in range(2):
        refused = saved[rank]["refused"]
        assert "rank-00001.pt is missing" in refused["missing"] and "merge the ranks' directories" in refused["missing"]
        assert "rank-00001.pt" in refused["earlier save"] and "belongs to save" in refused["earlier save"]
        assert refused["missing unchanged"] and refused["earlier save unchanged"]


def test_a_failing_rank_raises_a_checkpoint_error_as_the_others_do(runs):
    saved, _ = runs
    for rank in range(2):
        refused = saved[rank]["unwritable"]
        assert refused.startswith("CheckpointError: ") and "rank 1" in refused
        assert "preparing each rank's checkpoint directory" in refused and "Not a directory" in refused
