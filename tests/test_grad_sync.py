"""Ranks whose gradient hooks fire in different orders, and parameters unused on some ranks.

DeepSpeed lays out buckets in hook order and silently corrupts weights when ranks differ; zeroimpl's
layout depends on the parameter list only and buckets are launched in layout order, so the result must
be bitwise DDP's (find_unused_parameters=True) at world size 2.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from distributed import run_distributed
from zeroimpl import ShardedOptimizer
from zeroimpl.grad_sync import complete_through


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))
        self.never_used = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, rank, step):
        # rank 0 runs a then b, rank 1 runs b then a: backward reaches them in opposite orders
        h = self.b(torch.tanh(self.a(x))) if rank == 0 else self.a(torch.tanh(self.b(x)))
        if (rank + step) % 2 == 0:  # c is used by exactly one rank each step
            h = h + self.c(x)
        return self.head(torch.tanh(h)).square().mean()


def _run(rank, world_size, stage):
    results = {}
    for name in ("ddp", "zero"):
        model = Branchy()
        optimizer_kwargs = {"lr": 1e-2, "weight_decay": 0.0}  # a never-used param then stays put in both
        if name == "ddp":
            forward = DistributedDataParallel(model, find_unused_parameters=True)
            optimizer = torch.optim.AdamW(model.parameters(), **optimizer_kwargs)
        else:
            forward = model
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                         bucket_numel=72, **optimizer_kwargs)  # one Linear per bucket
        for step in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            forward(x, rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return results


def _both_stages(rank, world_size):
    return {stage: _run(rank, world_size, stage) for stage in (1, 2)}


def test_different_hook_orders_and_unused_parameters():
    for by_stage in run_distributed(2, _both_stages):  # both stages in one launch of 2 ranks
        for stage, rank_results in by_stage.items():
            for name, expected in rank_results["ddp"].items():
                assert torch.equal(rank_results["zero"][name], expected), (stage, name)
            assert torch.equal(rank_results["zero"]["never_used.weight"], Branchy().never_used.weight)


# -- in process --------------------------------------------------------------------------------------------------
class _Bucket:
    def __init__(self, param_indices):
        self.param_indices = param_indices


def _order(sizes_by_bucket):
    buckets = [_Bucket(params) for params in sizes_by_bucket]
    return buckets, [set() for _ in buckets]


def test_buckets_launch_in_index_order_whatever_order_gradients_arrive():
    """Every rank must issue the same collectives in the same order: a bucket starts only when it is complete
    and every bucket before it has started."""
    buckets, arrived = _order([[0, 1], [2], [3, 4, 5]])  # parameter indices per bucket
    for bucket, param in ((1, 2), (0, 0), (2, 5)):
        arrived[bucket].add(param)
        assert complete_through(arrived, buckets, 0) == 0  # bucket 1 complete, but bucket 0 is not
    arrived[0].add(1)
    assert complete_through(arrived, buckets, 0) == 2  # bucket 0 completes: 0, then the waiting 1
    arrived[2].add(3)
    assert complete_through(arrived, buckets, 2) == 2
    arrived[2].add(4)
    assert complete_through(arrived, buckets, 2) == 3


def test_a_bucket_without_every_gradient_waits_for_the_end_of_the_round():
    buckets, arrived = _order([[0], [1, 2], [3]])
    arrived[2].add(3)  # bucket 0 got no gradient on this rank: nothing starts before the end of the round
    assert complete_through(arrived, buckets, 0) == 0
    arrived[0].add(0)
    assert complete_through(arrived, buckets, 0) == 1  # bucket 1 still lacks parameter 2
