"""Guards for mutants of the step's core modules that survived the rest of the suite (mutation testing of
optimizer, step_checks, param_sync, grad_sync, ownership, inner,
verify, grad_shards, offload, buffers, uneven, module_buffers and grad_views). Each names the mutant it kills.

In-process (no process group):

* inner: ``InnerOptimizers.follow`` takes only the outer values changed since the last sync. Mutant: it copies
  every key again, so a ``momentum`` a scheduler once wrote into an AdamW group overwrites the ``betas`` the
  user set afterwards.
* grad_shards (the host store): ``clear(set_to_none=False)`` leaves a *zeroed* shard, which the next reduction overwrites without a
  host sync. Mutant: the shard is marked filled, and every bucket's next reduction waits for the copy stream
  and sums on the host (a host sync per bucket).
* buffers: ``sync_master_with_params`` records the versions it synced. Mutant: it forgets them, and every later
  sync compares the whole shard of every edited parameter again.

Distributed (one launch of 2 ranks, ``_world_size_2``):

* step_checks: a backward pass after the step's agreement (``found_nonfinite()`` / ``clip_grad_norm_``)
  forgets the verdict. Mutant: the verdict stands, and a parameter that got its first gradient in the later
  backward pass is not stepped (the stale verdict said no rank had a gradient for it).
* param_sync: ``ParamSync.end`` bumps the parameters' autograd versions (the all-gather writes them in place),
  so a backward through a graph built before ``step()`` raises as with torch. Mutant: no bump, and that
  backward silently uses the new weights.
* param_sync: ``ParamSync.end`` marks the masters in sync. Mutant: it does not, and every step's
  ``sync_masters`` compares every shard of a 16-bit model with its master again.
"""

from __future__ import annotations

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import SmallNet, small_batch
from zeroimpl import ShardedOptimizer
from zeroimpl.buffers import BucketStorage, flatten_params
from zeroimpl.inner import InnerOptimizers
from zeroimpl.layout import ParamSpec, build_layout
from zeroimpl.grad_shards import HostGradientShards


# -- in-process --------------------------------------------------------------------------------------------
def test_follow_takes_only_changed_outer_values_so_a_users_betas_outlive_an_old_momentum():
    """SGD (momentum) and AdamW (betas) groups: a momentum written once into the AdamW group goes to betas[0];
    betas the user sets afterwards must win, because that momentum did not change since."""
    sgd_param, adamw_param = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    outer = [{"params": [sgd_param], "lr": 0.1, "momentum": 0.9}, {"params": [adamw_param], "lr": 0.01}]
    inner = InnerOptimizers([{"params": [sgd_param]}, {"params": [adamw_param]}], [torch.optim.SGD, torch.optim.AdamW],
                            {torch.optim.SGD: {"lr": 0.1, "momentum": 0.9}, torch.optim.AdamW: {"lr": 0.01}})
    inner.fill_defaults(outer)
    outer[1]["momentum"] = 0.8  # a momentum scheduler over both classes writes `momentum` into every group
    inner.follow(outer)
    assert inner.param_groups[1]["betas"][0] == 0.8
    inner.report(outer)  # (after the step)
    outer[1]["betas"] = (0.5, 0.99)  # then the user sets betas directly
    inner.follow(outer)
    assert inner.param_groups[1]["betas"] == (0.5, 0.99)
    assert inner.param_groups[0]["momentum"] == 0.9  # unchanged outer values change nothing


def test_a_zeroed_host_shard_is_overwritten_without_a_host_sync():
    """zero_grad(set_to_none=False) with offload: the next reduction replaces the zeros as the first one of a step
    does (an asynchronous copy), never the blocking host sum of a shard already filled this step."""
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2), torch.zeros(3)])
    store.add(0, torch.tensor([1.0, 2.0]))
    store.add(1, torch.tensor([1.0, 2.0, 3.0]))
    store.ready()
    store.clear(set_to_none=False)
    waits = []
    store.wait_copies = lambda: waits.append(1)  # (CPU: no stream; count the host syncs the store asks for)
    store.add(0, torch.tensor([4.0, 5.0]))
    store.add(1, torch.tensor([6.0, 7.0, 8.0]))
    assert waits == [], "a zeroed shard was summed on the host (a host sync per bucket)"
    store.add(0, torch.tensor([1.0, 1.0]))  # a second reduction this step: summed on the host
    assert waits == [1]
    ready = store.ready()
    assert torch.equal(ready[0], torch.tensor([5.0, 6.0])) and torch.equal(ready[1], torch.tensor([6.0, 7.0, 8.0]))


def test_sync_master_with_params_compares_an_edited_parameter_once():
    """bf16 parameters (separate fp32 masters): an in-place edit is taken into the master at the next sync; the
    sync after that, with no edit in between, compares nothing."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, generator=generator).bfloat16()),
              torch.nn.Parameter(torch.randn(4, generator=generator).bfloat16())]
    layout = build_layout([ParamSpec(0, str(p.dtype), p.numel()) for p in params], world_size=2,
                          bucket_numel=1 << 10, alignment=1)
    storages = flatten_params(layout, params, rank=0)
    with torch.no_grad():
        params[0].mul_(2)  # an edit under no_grad: its version counter moves
    compared = []
    original = BucketStorage.published_values  # what the shard holds unedited: each comparison starts there
    BucketStorage.published_values = lambda self: compared.append(1) or original(self)
    try:
        for storage in storages:
            storage.sync_master_with_params()
        assert compared, "the edit was not looked at"
        assert all(torch.equal(s.master, s.shard.float()) for s in storages)  # the edit reached the master
        compared.clear()
        for storage in storages:
            storage.sync_master_with_params()
        assert compared == [], "a sync with no edit since the last one compared the shard again"
    finally:
        BucketStorage.published_values = original


# -- distributed ------------------------------------------------------------------------------------------
def _aux_late(rank: int, stage: int, query: bool):
    """Each step: a backward without the auxiliary head, (``query``) the step's NaN/Inf agreement, a backward
    with it, the step. Returns the final parameters and the auxiliary head's initial ones."""
    model = SmallNet()
    initial = {n: p.detach().clone() for n, p in model.aux_head.named_parameters()}
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_numel=64, lr=1e-2)
    for step in range(3):
        model(small_batch(rank, step, 0)).backward()
        if query:
            assert not optimizer.found_nonfinite()  # the verdict: no rank has an aux_head gradient yet
        model(small_batch(rank, step, 1), use_aux=True).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, initial


def _stale_graph(rank: int):
    """A graph built before step(), backward after it: torch refuses (the step wrote the weights in place)."""
    model = SmallNet()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, bucket_numel=64, lr=1e-2)
    model(small_batch(rank, 0)).backward()
    stale = model(small_batch(rank, 1))
    optimizer.step()
    try:
        stale.backward()
    except RuntimeError as error:
        return str(error)
    finally:
        optimizer.zero_grad()
    return "no error"


def _masters_in_sync_after_step(rank: int):
    """A bf16 model: after step() the masters are in sync with the parameters, so sync_masters compares nothing."""
    model = SmallNet().bfloat16()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_numel=64, lr=1e-2)
    model(small_batch(rank, 0).bfloat16()).float().backward()
    optimizer.step()
    optimizer.finish_param_gathers()
    compared = []
    original = torch.equal
    torch.equal = lambda a, b: compared.append(1) or original(a, b)
    try:
        optimizer.sync_masters()
    finally:
        torch.equal = original
    return len(compared)


def _world_size_2(rank, world_size):
    return run_cases({
        **{(stage, query): (lambda stage=stage, query=query: _aux_late(rank, stage, query))
           for stage in (1, 2) for query in (False, True)},
        "stale graph": lambda: _stale_graph(rank),
        "masters in sync": lambda: _masters_in_sync_after_step(rank),
    })


@pytest.fixture(scope="module")
def world_size_2():
    return run_distributed(2, _world_size_2)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_gradient_arriving_after_the_agreement_is_stepped(world_size_2, stage):
    """The verdict of found_nonfinite() between two backward passes is forgotten by the second one: a parameter
    whose first gradient comes then is stepped, bitwise as without the query (stage 2 reduces each pass alike;
    stage 1 reduces once more, so within 1e-6)."""
    for (queried, initial), (plain, _) in zip(case_results(world_size_2, (stage, True)),
                                              case_results(world_size_2, (stage, False))):
        for name, value in initial.items():
            assert not torch.equal(queried["aux_head." + name], value), f"aux_head.{name} was not stepped"
        for name in plain:
            if stage == 2:
                assert torch.equal(queried[name], plain[name]), name
            else:
                torch.testing.assert_close(queried[name], plain[name], rtol=0, atol=1e-6)


def test_backward_through_a_graph_built_before_step_raises_as_with_torch(world_size_2):
    for message in case_results(world_size_2, "stale graph"):
        assert "modified by an inplace operation" in message


def test_step_leaves_the_masters_in_sync(world_size_2):
    assert case_results(world_size_2, "masters in sync") == [0, 0]
