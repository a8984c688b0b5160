"""Ranks whose gradient hooks fire in different orders, and parameters unused on some ranks.

DeepSpeed lays out buckets in hook order and silently corrupts weights when ranks differ; zeroimpl's
layout depends on the parameter list only and buckets are launched in layout order, so the result must
be bitwise DDP's (find_unused_parameters=True) at world size 2.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from distributed import run_distributed
from zeroimpl import ShardedOptimizer


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
