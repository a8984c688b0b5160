"""Guards for mutants of the step's core modules that survived the rest of the suite (mutation testing of
optimizer, step_checks, param_sync, grad_sync, ownership, inner,
verify, grad_shards, offload, buffers, uneven, module_buffers and grad_views). Each names the mutant it kills.

The in-process guards of this kind live with their modules' tests: inner's ``follow`` in test_inner.py, the host
store's zeroed shard in test_grad_shards.py, ``sync_master_with_params`` in test_buffers.py.

Distributed (one launch of 2 ranks, ``_world_size_2``):

* step_checks: a backward pass after the step's agreement (``found_nonfinite()`` / ``clip_grad_norm_``)
  forgets the verdict. Mutant: the verdict stands, and a parameter that got its first gradient in the later
  backward pass is not stepped (the stale verdict said no rank had a gradient for it).
* param_sync: ``ParamSync.start_param_sync`` bumps the parameters' autograd versions (the all-gather writes them in place),
  so a backward through a graph built before ``step()`` raises as with torch. Mutant: no bump, and that
  backward silently uses the new weights.
* param_sync: ``ParamSync.start_param_sync`` marks the masters in sync. Mutant: it does not, and every step's
  ``sync_masters`` compares every shard of a 16-bit model with its master again.
"""

from __future__ import annotations

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import SmallNet, small_batch
from zeroimpl import ShardedOptimizer


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
