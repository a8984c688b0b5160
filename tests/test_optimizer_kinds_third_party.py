"""Optimizers people use from outside torch train exactly as under DDP (issue 28), recognised without sharding
options: timm's Adan (a step counter in the param group) and Lamb (a trust ratio per parameter: whole
parameters), and schedule-free AdamW, SGD and RAdam (``k``, ``weight_sum`` and ``lr_max`` in the group,
``optimizer.train()`` / ``optimizer.eval()`` moving the parameters between two points), on stages 1 and 2,
with and without offload, through a checkpoint and a resume.

Reference: DDP + the same optimizer on :class:`SmallNet`, world size 2, fp32: bitwise, parameters and group-level
state. Lamb clipping by the norm of every gradient it steps (its default ``max_grad_norm=1.0``) is refused on
every rank with the fix, since a rank steps only its shard.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from functools import partial

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from distributed import case_results, run_cases, run_distributed
from workloads import SmallNet, small_batch
from zeroimpl import ShardedOptimizer
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

schedulefree = pytest.importorskip("schedulefree", reason="pip install schedulefree (the test extra installs it)")


def _timm_optimizers() -> types.SimpleNamespace:
    """timm's own Adan and Lamb from the installed timm, loaded without timm's package ``__init__``, which imports
    torchvision: the registries here hold only a CUDA torchvision, which cannot load beside the CPU torch, so
    the README installs timm with --no-deps (its optimizers need torch alone). The modules keep their names
    (``timm.optim.adan``), so the classes pickle to the worker processes by reference."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        pytest.skip("pip install --no-deps timm (the README's test command does)", allow_module_level=True)
    root = os.path.dirname(spec.origin)
    for name, path, package_spec in (("timm", root, spec), ("timm.optim", os.path.join(root, "optim"), None)):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [path]
            package.__spec__ = package_spec or importlib.machinery.ModuleSpec(name, None, is_package=True)
            sys.modules[name] = package
    return types.SimpleNamespace(Adan=importlib.import_module("timm.optim.adan").Adan,
                                 Lamb=importlib.import_module("timm.optim.lamb").Lamb)


timm_optim = _timm_optimizers()

STEPS = 4
# each class with its keyword arguments; zeroimpl recognises them (flat, Lamb whole) without sharding options
OPTIMIZERS = {
    "Adan": (timm_optim.Adan, {"lr": 1e-2, "weight_decay": 0.02}),
    "Lamb": (timm_optim.Lamb, {"lr": 1e-2, "max_grad_norm": None}),
    "AdamWScheduleFree": (schedulefree.AdamWScheduleFree, {"lr": 1e-2, "warmup_steps": 2}),
    "SGDScheduleFree": (schedulefree.SGDScheduleFree, {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.01}),
    "RAdamScheduleFree": (schedulefree.RAdamScheduleFree, {"lr": 1e-2}),
}
SETTINGS = [(stage, offload) for stage in (1, 2) for offload in (None, "cpu")]


def _build(name, model, setting):
    """``setting``: None for the plain optimizer (under DDP), else (stage, offload) for a ShardedOptimizer."""
    optimizer_class, kwargs = OPTIMIZERS[name]
    if setting is None:
        optimizer = optimizer_class(model.parameters(), **kwargs)
    else:
        stage, offload = setting
        optimizer = ShardedOptimizer(model.parameters(), optimizer_class, stage=stage, offload=offload,
                                     bucket_numel=128, **kwargs)
    if hasattr(optimizer, "train"):  # schedule-free: train mode before the first step, as its docs require
        optimizer.train()
    return optimizer


def _train(rank, model, optimizer, setting, start, steps):
    forward = DistributedDataParallel(model, find_unused_parameters=True) if setting is None else model
    for step in range(start, start + steps):
        forward(small_batch(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _snapshot(model, optimizer):
    """The parameters and the first group's own values (not its parameters)."""
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "optimizer")})


def _run(rank, name, setting, directory=None):
    """STEPS steps; then, where the class has modes, the evaluation point (``eval()``) and two more steps after
    ``train()``; ``directory``: save after 2 steps and resume a new model and optimizer from the checkpoint.
    Returns a snapshot after each phase."""
    model = SmallNet()
    optimizer = _build(name, model, setting)
    snapshots = []
    if directory is None:
        _train(rank, model, optimizer, setting, 0, STEPS)
    else:
        _train(rank, model, optimizer, setting, 0, 2)
        save_checkpoint(directory, optimizer, model)
        del optimizer
        model = SmallNet()
        optimizer = _build(name, model, setting)
        load_checkpoint(directory, optimizer, model)
        _train(rank, model, optimizer, setting, 2, STEPS - 2)
    snapshots.append(_snapshot(model, optimizer))
    if hasattr(optimizer, "eval") and callable(getattr(OPTIMIZERS[name][0], "eval", None)):
        optimizer.eval()
        snapshots.append(_snapshot(model, optimizer))
        optimizer.train()
        _train(rank, model, optimizer, setting, STEPS, 2)
        snapshots.append(_snapshot(model, optimizer))
    return snapshots


_references: dict[str, list] = {}  # DDP's run per class, made once per rank process


def _differences(rank, name, setting, directory=None):
    """Per phase: the parameters that differ from DDP's and whether the group's own values equal DDP's."""
    if name not in _references:
        _references[name] = _run(rank, name, None)
    reference = _references[name]
    ours = _run(rank, name, setting, directory)
    assert len(ours) == len(reference)
    return [([n for n in ref_params if not torch.equal(params[n], ref_params[n])],
             {k: group[k] for k in ref_group} == ref_group)
            for (params, group), (ref_params, ref_group) in zip(ours, reference)]


def _lamb_clipping(rank):
    try:
        ShardedOptimizer(SmallNet().parameters(), timm_optim.Lamb, bucket_numel=128, collective_timeout=10)
    except ValueError as error:
        return str(error)
    return None


def _lamb_is_whole(rank):
    """Lamb stays whole-parameter even under assume_elementwise (which is for the classes zeroimpl does not know):
    every parameter steps on one rank, in its own shape."""
    optimizer = ShardedOptimizer(SmallNet().parameters(), timm_optim.Lamb, bucket_numel=128, max_grad_norm=None,
                                 assume_elementwise=True)
    return all(bucket.whole for bucket in optimizer.layout.buckets)


def _all(rank, world_size, directory):
    cases = {}
    for name in OPTIMIZERS:
        for setting in SETTINGS:
            cases[("parity", name, setting)] = partial(_differences, rank, name, setting)
        cases[("resume", name)] = partial(_differences, rank, name, (2, "cpu"), f"{directory}/{name}")
    cases["lamb clipping"] = partial(_lamb_clipping, rank)
    cases["lamb whole"] = partial(_lamb_is_whole, rank)
    return run_cases(cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(2, _all, str(tmp_path_factory.mktemp("third_party")))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("setting", SETTINGS, ids=[f"stage{s}-{o or 'device'}" for s, o in SETTINGS])
def test_trains_bitwise_as_under_ddp(ranks, name, setting):
    for phases in case_results(ranks, ("parity", name, setting)):
        for differing, same_group in phases:
            assert differing == [], f"parameters differ from DDP + {name}: {differing}"
            assert same_group, "the param group's own values (step counter, k, weight_sum) differ from DDP's"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resume_from_a_checkpoint_trains_on_bitwise(ranks, name):
    for phases in case_results(ranks, ("resume", name)):
        assert phases == [([], True)] * len(phases)


def test_lamb_clipping_by_its_global_norm_is_refused_on_every_rank_with_the_fix(ranks):
    for message in case_results(ranks, "lamb clipping"):
        assert message is not None and "max_grad_norm=None" in message and "clip_grad_norm_" in message, message


def test_lamb_is_sharded_by_whole_parameters_even_under_assume_elementwise(ranks):
    assert all(case_results(ranks, "lamb whole"))
