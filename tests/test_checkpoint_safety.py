"""Checkpoints that must not be loaded, and saves that die half-way.

* A save killed at any point (a rank dying while writing its file, rank 0 dying while writing the index, or
  between the renames that publish) leaves the previous checkpoint in place and loadable.
* Truncated, altered, missing or foreign files, and checkpoints of another model or optimizer, are refused
  with a CheckpointError on every rank, before anything is changed.
* Files are never unpickled: a crafted file that would run code on load is refused and the code never runs.
"""

import os
import pickle
import re
import shutil

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer
from zeroimpl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zeroimpl.checkpoint import files


def _make(model_name="gpt2", optimizer_class=torch.optim.AdamW):
    model = build_model(model_name)
    return model, ShardedOptimizer(param_groups(model), optimizer_class, stage=2, bucket_numel=4096, lr=1e-2)


def _train(model, optimizer, rank, steps):
    for step in steps:
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.step()
        optimizer.zero_grad()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- saves that die ----------------------------------------------------------------------------------
def _die_during_save(rank, world_size, directory, crash_point):
    """Save a good checkpoint after 2 steps, then die at ``crash_point`` while saving over it after 3."""
    model, optimizer = _make()
    _train(model, optimizer, rank, range(2))
    save_checkpoint(directory, optimizer, model)
    torch.save(_params(model), os.path.join(directory + ".expected-%d" % rank))
    _train(model, optimizer, rank, range(2, 3))

    real_write, real_rename = files.write, os.rename
    if crash_point == "rank file" and rank == 1:
        def write(obj, path):
            with open(path, "wb") as handle:  # half a file, then the process is gone
                handle.write(pickle.dumps(obj)[:1000])
            os._exit(9)
        files.write = write
    if crash_point == "index" and rank == 0:
        files.write = lambda obj, path: os._exit(9) if path.endswith(files.INDEX) else real_write(obj, path)
    if crash_point == "between renames" and rank == 0:
        calls = []

        def rename(source, target):
            calls.append(source)
            if len(calls) == 2:  # the old checkpoint is moved aside, the new one not yet in place
                os._exit(9)
            real_rename(source, target)
        files.os.rename = rename
    save_checkpoint(directory, optimizer, model)


def _load_after_crash(rank, world_size, directory):
    model, optimizer = _make()
    load_checkpoint(directory, optimizer, model)
    expected = torch.load(directory.rstrip("/") + ".expected-%d" % rank)
    restored = all(torch.equal(p, expected[n]) for n, p in _params(model).items())
    save_checkpoint(directory, optimizer, model)  # saving again after the crash works and cleans up
    return restored, sorted(os.listdir(os.path.dirname(directory)))


CRASH_POINTS = ["rank file", "index", "between renames"]


def _crash_directory(root, crash_point):
    return os.path.join(root, crash_point.replace(" ", "-"), "checkpoint")


def _after_the_crashes(rank, world_size, root):
    """Every multi-rank check after the saves that died, in one launch of 2 ranks (each builds its own model
    and optimizer, in its own folder)."""
    return {"loaded": {point: _load_after_crash(rank, world_size, _crash_directory(root, point))
                       for point in CRASH_POINTS},
            "refusals": _refusals(rank, world_size, os.path.join(root, "refusals")),
            "malicious": _malicious(rank, world_size, os.path.join(root, "malicious"))}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Each killed save in its own launch (its ranks die); what each left on disk is recorded before the
    one launch of ``_after_the_crashes`` loads and saves over it."""
    root = str(tmp_path_factory.mktemp("checkpoint_safety"))
    crashes = {}
    for crash_point in CRASH_POINTS:
        directory = _crash_directory(root, crash_point)
        os.makedirs(os.path.dirname(directory))
        try:
            run_distributed(2, _die_during_save, directory, crash_point, timeout=120)
            error = None
        except AssertionError as raised:
            error = str(raised)
        crashes[crash_point] = {"error": error, "directory": os.path.exists(directory),
                                "previous": os.path.exists(directory + ".previous"),
                                "partial": os.path.exists(directory + ".partial"),
                                "index": os.path.exists(os.path.join(directory, files.INDEX))}
    os.makedirs(os.path.join(root, "refusals"))
    os.makedirs(os.path.join(root, "malicious"))
    return crashes, run_distributed(2, _after_the_crashes, root)


@pytest.mark.parametrize("crash_point", CRASH_POINTS)
def test_a_killed_save_leaves_the_previous_checkpoint_loadable(launches, crash_point):
    crashes, after = launches
    on_disk = crashes[crash_point]
    assert on_disk["error"] is not None and re.search("killed or crashed|exit", on_disk["error"])  # it died
    if crash_point == "between renames":
        assert not on_disk["directory"] and on_disk["previous"]
    else:  # died half-way through writing the new checkpoint, next to the intact old one
        assert on_disk["partial"] and on_disk["index"]
    for restored, listing in (by_rank["loaded"][crash_point] for by_rank in after):
        assert restored
        assert "checkpoint" in listing and "checkpoint.partial" not in listing and "checkpoint.previous" not in listing


# -- checkpoints that must be refused ----------------------------------------------------------------
def _damage(directory, how):
    target = os.path.join(directory, files.rank_file(1))
    if how == "truncated":
        with open(target, "r+b") as handle:
            handle.truncate(os.path.getsize(target) // 2)
    elif how == "bit flip":
        with open(target, "r+b") as handle:
            handle.seek(os.path.getsize(target) // 2)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 1]))
    elif how == "missing shard":
        os.remove(target)
    elif how == "no index":
        os.remove(os.path.join(directory, files.INDEX))


def _refusals(rank, world_size, root):
    model, optimizer = _make()
    _train(model, optimizer, rank, range(2))
    good = os.path.join(root, "good")
    save_checkpoint(good, optimizer, model)
    messages = {}
    for how in ("truncated", "bit flip", "missing shard", "no index", "other model", "other optimizer"):
        copy = os.path.join(root, how.replace(" ", "-"))
        if rank == 0:
            shutil.copytree(good, copy)
            _damage(copy, how)
        torch.distributed.barrier()
        if how == "other model":
            target_model, target = _make("llama")
        elif how == "other optimizer":
            target_model, target = _make(optimizer_class=torch.optim.Adam)
        else:
            target_model, target = _make()
        before = _params(target_model)
        try:
            load_checkpoint(copy, target, target_model)
            messages[how] = None
        except CheckpointError as error:
            messages[how] = str(error)
        assert all(torch.equal(p, before[n]) for n, p in _params(target_model).items()), how  # nothing changed
    return messages


def test_damaged_or_foreign_checkpoints_are_refused_on_every_rank(launches):
    for rank, messages in enumerate(by_rank["refusals"] for by_rank in launches[1]):
        assert "is corrupt" in messages["truncated"] or "rank 1 failed" in messages["truncated"]
        assert "is corrupt" in messages["bit flip"] or "rank 1 failed" in messages["bit flip"]
        assert "rank-00001.pt is missing" in messages["missing shard"]
        assert "not a complete checkpoint" in messages["no index"]
        assert "another model" in messages["other model"]
        assert "step with ['torch.optim.adamw.AdamW', 'torch.optim.adamw.AdamW']; this optimizer's with ['torch.optim.adam.Adam'" in messages["other optimizer"]


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))


def _malicious(rank, world_size, root):
    model, optimizer = _make()
    save_checkpoint(os.path.join(root, "checkpoint"), optimizer, model)
    outcome = {}
    for name in (files.INDEX, files.rank_file(0)):
        directory = os.path.join(root, "evil-" + name)
        if rank == 0:
            shutil.copytree(os.path.join(root, "checkpoint"), directory)
            path = os.path.join(directory, name)
            _RunsCode.marker = os.path.join(root, "pwned")
            torch.save({"payload": _RunsCode()}, path)
            if name != files.INDEX:  # the attacker rewrites the index's checksum too
                index = torch.load(os.path.join(directory, files.INDEX), weights_only=True)
                index["files"][name] = {"bytes": os.path.getsize(path), "sha256": files.sha256(path)}
                torch.save(index, os.path.join(directory, files.INDEX))
        torch.distributed.barrier()
        target_model, target = _make()
        try:
            load_checkpoint(directory, target, target_model)
            outcome[name] = None
        except CheckpointError as error:
            outcome[name] = str(error)
    return outcome, os.path.exists(os.path.join(root, "pwned"))


def test_files_are_never_unpickled(launches):
    for outcome, code_ran in (by_rank["malicious"] for by_rank in launches[1]):
        assert not code_ran
        assert "cannot be read safely" in outcome[files.INDEX]
        assert "cannot be read safely" in outcome[files.rank_file(0)] or "rank 0 failed" in outcome[files.rank_file(0)]
