"""state_dict() / load_state_dict() on the same world size: resuming is bitwise uninterrupted training.

state_dict() is called on rank 0 alone mid-run (as Hugging Face Trainer does): it must not communicate.
"""

import copy

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer


def _make(dtype, stage, optimizer_name, offload=None):
    model = build_model("gpt2", dtype)
    optimizer_class, kwargs = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}),
                               "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}[optimizer_name]
    optimizer = ShardedOptimizer(param_groups(model), optimizer_class, stage=stage, bucket_numel=4096,
                                 offload=offload, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, schedule


def _train(rank, model, optimizer, schedule, steps):
    for step in steps:
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def _resume(rank, world_size, dtype, stage, optimizer_name, offload=None):
    model, optimizer, schedule = _make(dtype, stage, optimizer_name, offload)
    _train(rank, model, optimizer, schedule, range(3))
    if rank == 0:  # on one rank only: would hang if state_dict() communicated
        optimizer.state_dict()
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), schedule.state_dict()))
    _train(rank, model, optimizer, schedule, range(3, 6))
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, optimizer, schedule = _make(dtype, stage, optimizer_name, offload)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    schedule.load_state_dict(saved[2])
    _train(rank, model, optimizer, schedule, range(3, 6))
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    return uninterrupted, resumed, optimizer.loss_scale


ROUND_TRIPS = [
    (torch.float32, 1, "adamw", None), (torch.float32, 2, "sgd", None), (torch.bfloat16, 2, "adamw", None),
    (torch.float16, 1, "adamw", None), (torch.float32, 2, "adamw", "cpu"), (torch.float16, 2, "adamw", "cpu"),
    (torch.bfloat16, 1, "sgd", "cpu"),
]


@pytest.mark.parametrize("dtype,stage,optimizer_name,offload", ROUND_TRIPS)
def test_round_trip_resumes_bitwise(runs, dtype, stage, optimizer_name, offload):
    for by_rank in runs:
        uninterrupted, resumed, _ = by_rank["round_trips"][(dtype, stage, optimizer_name, offload)]
        for name in uninterrupted:
            assert torch.equal(uninterrupted[name], resumed[name]), name


def _mismatch(rank, world_size):
    model, optimizer, _ = _make(torch.float32, 2, "adamw")
    errors = {}
    other_rank = copy.deepcopy(optimizer.state_dict())
    other_rank["rank"] = 1 - rank
    plain = torch.optim.AdamW(build_model("gpt2").parameters()).state_dict()
    smaller = build_model("gpt2")
    smaller_opt = ShardedOptimizer(param_groups(smaller)[:1], torch.optim.AdamW, bucket_numel=4096)
    regrouped = build_model("gpt2")  # the same model, with all parameters in one param group
    regrouped_opt = ShardedOptimizer([{"params": list(regrouped.parameters())}], torch.optim.AdamW, bucket_numel=4096)
    states = {"other_rank": other_rank, "plain": plain, "other_model": smaller_opt.state_dict(),
              "other_groups": regrouped_opt.state_dict()}
    for name, state in states.items():
        try:
            optimizer.load_state_dict(state)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _all_runs(rank, world_size):
    """Every round trip, then the refusals, in one launch of 2 ranks (each builds its own model and optimizer)."""
    return {"round_trips": {config: _resume(rank, world_size, *config) for config in ROUND_TRIPS},
            "mismatch": _mismatch(rank, world_size)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _all_runs)


def test_mismatched_state_is_refused(runs):
    for errors in (by_rank["mismatch"] for by_rank in runs):
        assert "saved by rank" in errors["other_rank"]
        assert "param groups do not match" in errors["plain"]  # (a full torch state of other groups)
        assert "layout" in errors["other_model"] and "layout" in errors["other_groups"]
